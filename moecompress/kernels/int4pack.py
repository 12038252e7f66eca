"""torch's packed-INT4 CPU matmul (``aten._weight_int4pack_mm_for_cpu``) for MXFP4 and 4-bit integer weights.

The op multiplies bf16 inputs by weights ``(q - 8) · s + z`` (``q`` 0..15 in torch's tiled layout, ``s`` and ``z``
bf16 per group of 32..256 input columns, decoded in float32, accumulated in float32). Our formats map onto it:

- INT4 ``(c - z₀) · s`` is ``(c - 8) · s + (8 - z₀) · s``: the codes as they are, the offset as the zero. Symmetric
  weights (``z₀ = 8``) are exact; an asymmetric zero ``(8 - z₀) · s`` is rounded to bf16 (relative 2⁻⁹). The
  reference rounds each weight ``(c - z₀) · s`` to bf16 instead, so both differ from the exact product by at most
  half a bf16 ulp of the weight or of its offset.
- MXFP4 ``v · 2^e`` with ``v`` E2M1: ``2v`` is in {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}; split it as ``L + 2H`` with
  ``L = 2v`` where ``|2v| ≤ 3`` (else 0) and ``H = v`` where ``|2v| ≥ 4`` (else 0), so ``v · 2^e = L · 2^(e-1) +
  H · 2^e`` with ``L`` in [-3, 3] and ``H`` in {0, ±2, ±3, ±4, ±6}, both signed 4-bit. The two halves are one
  matrix of twice the width (``[L | H]``, scales ``2^(e-1)`` then ``2^e``, powers of two exact in bf16) multiplied
  by the input written twice, so one call sums both in float32: exact up to summation order.

The float32-input variant of the op is a slow reference (about 25x slower than bf16 on one thread), so only bf16
inputs take this route.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import mxfp4
from .packing import unpack_codes

GROUP_SIZES = (32, 64, 128, 256)
"""Group sizes the op accepts."""

_TILE_ROWS = 64
"""torch's tiled layout interleaves blocks of 64 output rows (rows ``j`` and ``j + 32`` share a byte)."""

_E2M1_LOW = (8, 9, 10, 11, 8, 8, 8, 8, 8, 7, 6, 5, 8, 8, 8, 8)
"""``L + 8`` per E2M1 code (codes 0..7 are magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; 8..15 their negatives): the
definition :func:`_mxfp4_halves` computes two codes at a time."""
_E2M1_HIGH = (8, 8, 8, 8, 10, 11, 12, 14, 8, 8, 8, 8, 6, 5, 4, 2)
"""``H + 8`` per E2M1 code."""


def available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


@dataclass(frozen=True)
class Int4Packed:
    """One weight ``[N, K]`` in the op's layout: ``packed`` uint8 ``[N, K'/2]``, ``scales_and_zeros`` bf16
    ``[K'/group_size, N, 2]``; ``repeats`` is how many times the input is written side by side (``K' = repeats ·
    K``: 2 for MXFP4's two halves)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int
    repeats: int = 1

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


def tiled(packed: np.ndarray) -> np.ndarray:
    """Our packed codes ``[N, K/2]`` (even column in the low nibble) in torch's tiled layout ``[N, K/2]``, by byte
    operations (rows a multiple of 64)."""
    rows, half = packed.shape
    tiles = packed.reshape(rows // _TILE_ROWS, 2, _TILE_ROWS // 2, half)
    first, second = tiles[:, 0], tiles[:, 1]
    out = np.empty((rows // _TILE_ROWS, half, 2, _TILE_ROWS // 2), np.uint8)
    out[:, :, 0] = ((first & 15) | ((second & 15) << 4)).transpose(0, 2, 1)
    out[:, :, 1] = ((first >> 4) | (second & 0xF0)).transpose(0, 2, 1)
    return out.reshape(rows, half)


def _tiled_any(packed: np.ndarray) -> torch.Tensor:
    if packed.shape[0] % _TILE_ROWS == 0:
        return torch.from_numpy(tiled(packed))
    codes = unpack_codes(torch.from_numpy(packed), 4).to(torch.int32)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)


def _mxfp4_halves(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``L + 8`` and ``H + 8`` of both codes in each byte, packed as the codes are (each nibble computed on its
    own: no step carries or borrows across the nibble boundary)."""
    magnitude = packed & 0x77
    sign_mask = ((packed >> 3) & 0x11) * 15
    large = (magnitude >> 2) & 0x11
    low = magnitude & ((large ^ 0x11) * 7)
    high = ((magnitude | 0x44) - 0x22 + (magnitude & (magnitude >> 1) & (magnitude >> 2) & 0x11)) & (large * 15)
    return tuple(((0x88 + m) & ~sign_mask) | ((0x88 - m) & sign_mask) for m in (low, high))


def _scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    return torch.stack([scales, zeros], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()


def from_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int) -> Int4Packed:
    """INT4 codes ``[N, K/2]`` (ours: even column in the low nibble), bf16 scales and uint8 zero points
    ``[N, K/G]`` (None: symmetric)."""
    offsets = torch.zeros_like(scales) if zeros is None else (8.0 - zeros.float()) * scales.float()
    return Int4Packed(_tiled_any(packed.contiguous().numpy()), _scales_and_zeros(scales, offsets), group_size)


def from_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> Int4Packed:
    """MXFP4 codes ``[N, K/2]`` and E8M0 scales ``[N, K/32]`` as the two halves ``[L | H]``."""
    both = np.concatenate(_mxfp4_halves(packed.contiguous().numpy()), axis=1)
    scale = mxfp4.power_of_two(scales.to(torch.int32) - mxfp4.E8M0_BIAS)
    both_scales = torch.cat([scale * 0.5, scale], dim=1)
    return Int4Packed(
        _tiled_any(both), _scales_and_zeros(both_scales, torch.zeros_like(both_scales)), mxfp4.BLOCK_SIZE, repeats=2
    )


def linear(x: torch.Tensor, weight: Int4Packed) -> torch.Tensor:
    """``x @ Wᵀ`` for bf16 ``x`` ``[..., K]``, in bf16."""
    rows = x.reshape(-1, x.shape[-1])
    rows = torch.cat([rows] * weight.repeats, dim=1) if weight.repeats > 1 else rows.contiguous()
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight.packed, weight.group_size, weight.scales_and_zeros)
    return out.reshape(*x.shape[:-1], out.shape[-1])
