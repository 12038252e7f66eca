"""MXFP4 (OCP Microscaling Formats v1.0): E2M1 elements in blocks of 32 along the input dimension, one E8M0
scale per block.

Element codes are 4 bits ``s e1 e0 m``: magnitudes ``0, .5, 1, 1.5, 2, 3, 4, 6`` for codes 0..7, bit 3 the sign.
A scale is stored as its exponent plus 127 (E8M0); 255 (NaN) is never written. Two codes per byte, the even
element in the low nibble.

Scale rules for a block with largest magnitude ``amax``:

- ``floor`` (the OCP reference): exponent ``floor(log2(amax)) - 2``; elements above 6 after scaling saturate.
- ``ceil`` (the rounding gpt-oss checkpoints use): exponent ``ceil(log2(amax / 6))``, the smallest scale at
  which nothing saturates.

Elements are rounded to the nearest representable value, ties to the even code (mantissa bit 0).
This module is the definition: the GPU kernels and every export are tested against it.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from .packing import pack_codes, unpack_codes

BLOCK_SIZE = 32
E8M0_BIAS = 127
ScaleRule = Literal["floor", "ceil"]
SCALE_RULES: tuple[str, ...] = get_args(ScaleRule)

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = torch.tensor(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES), dtype=torch.float32)

# Midpoints between consecutive magnitudes; at a tie the even code wins, i.e. the lower neighbour when it is
# even (codes 0, 2, 4, 6), otherwise the upper one.
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIE_GOES_UP = torch.tensor([False, True, False, True, False, True, False])


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of already-scaled values: nearest, ties to even, saturating at ±6."""
    magnitude = scaled.abs().float()
    code = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
    for midpoint, up in zip(_MIDPOINTS.tolist(), _TIE_GOES_UP.tolist(), strict=True):
        code += (magnitude >= midpoint) if up else (magnitude > midpoint)
    negative = (scaled < 0) & (code > 0)
    return code | (negative.to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return E2M1_VALUES.to(device=codes.device, dtype=dtype)[codes.long()]


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """``2 ** exponent`` exactly, as float32 (multiplying by it is exact, unlike a general scale)."""
    return torch.exp2(exponent.float())


def block_exponents(blocks: torch.Tensor, scale_rule: ScaleRule = "floor") -> torch.Tensor:
    """Unbiased int32 scale exponents of ``blocks`` ``[..., 32]`` (one per block), clamped to E8M0's range."""
    amax = blocks.abs().amax(dim=-1).float()
    if scale_rule == "floor":
        exponent = floor_log2(amax) - 2
    elif scale_rule == "ceil":
        exponent = ceil_log2(amax / 6.0)
    else:
        raise ValueError(f"unknown scale rule {scale_rule!r}; choose from {SCALE_RULES}")
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, -E8M0_BIAS))
    return exponent.clamp(-E8M0_BIAS, E8M0_BIAS)


def floor_log2(values: torch.Tensor) -> torch.Tensor:
    """``floor(log2(v))`` exactly (from the float's exponent; ``torch.log2`` rounds just below powers of two)."""
    _, exponent = torch.frexp(values)
    return exponent - 1


def ceil_log2(values: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(v))`` exactly: one more than :func:`floor_log2` unless ``v`` is a power of two."""
    mantissa, exponent = torch.frexp(values)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def quantize_mxfp4(weight: torch.Tensor, scale_rule: ScaleRule = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[..., K]`` (K a multiple of 32) → (packed codes uint8 ``[..., K/2]``, E8M0 scales uint8
    ``[..., K/32]``)."""
    if weight.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of {BLOCK_SIZE}, got {weight.shape[-1]}")
    blocks = weight.float().reshape(*weight.shape[:-1], -1, BLOCK_SIZE)
    exponent = block_exponents(blocks, scale_rule)
    codes = e2m1_codes(blocks * power_of_two(-exponent).unsqueeze(-1))
    packed = pack_codes(codes.reshape(weight.shape), 4)
    return packed, (exponent + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`quantize_mxfp4`: ``[..., K]`` values in ``dtype``."""
    codes = unpack_codes(packed, 4)
    values = e2m1_values(codes).reshape(*codes.shape[:-1], -1, BLOCK_SIZE)
    exponent = scales.to(torch.int32) - E8M0_BIAS
    return (values * power_of_two(exponent).unsqueeze(-1)).reshape(codes.shape).to(dtype)
