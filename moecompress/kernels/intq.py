"""Group-wise integer weights (INT4, INT2): each run of ``group_size`` weights along the input dimension shares a
scale ``s`` (and, asymmetric, a zero point ``z``); codes are unsigned ``b``-bit integers and a weight is
``(code - z) * s``.

- symmetric: ``s = 2·amax / (2**b - 1)`` and the fixed ``z = 2**(b-1)`` (GPTQ's and compressed-tensors'
  convention; for INT4, codes -8..7 around zero with the scale ``amax / 7.5``);
- asymmetric: the group's range is widened to include 0, ``s = (max - min) / (2**b - 1)`` and
  ``z = round(-min / s)``, stored per group as uint8.

Scales are stored in bfloat16, rounded *up* so the grid still spans the group (no weight lands more than half a
step from the grid), and codes are computed against the stored scale, so quantising and dequantising agree
exactly. A dequantised weight is the product rounded once to bfloat16 (the precision a bf16 model holds it in).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .packing import pack_codes, unpack_codes

SCALE_DTYPE = torch.bfloat16
GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class IntGrid:
    """A group's quantisation grid: scales ``[..., 1]`` (float32 values of the stored bf16) and zero points."""

    scale: torch.Tensor
    zero: torch.Tensor


def _stored_scale(exact: torch.Tensor) -> torch.Tensor:
    """``exact`` rounded up to the nearest bfloat16, as float32; 1 where the group is all zeros."""
    stored = exact.to(SCALE_DTYPE)
    below = stored.float() < exact
    stored = torch.where(below, torch.nextafter(stored, torch.full_like(stored, float("inf"))), stored).float()
    return torch.where(stored > 0, stored, torch.ones_like(stored))


def group_grid(groups: torch.Tensor, bits: int, symmetric: bool) -> IntGrid:
    """The grid of each group in ``groups`` ``[..., G]`` (reduced over the last dim)."""
    levels = 2**bits - 1
    groups = groups.float()
    if symmetric:
        amax = groups.abs().amax(dim=-1, keepdim=True)
        scale = _stored_scale(2 * amax / levels)
        zero = torch.full_like(scale, 2 ** (bits - 1))
        return IntGrid(scale, zero)
    low = groups.amin(dim=-1, keepdim=True).clamp_max(0)
    high = groups.amax(dim=-1, keepdim=True).clamp_min(0)
    scale = _stored_scale((high - low) / levels)
    zero = torch.round(-low / scale).clamp(0, levels)
    return IntGrid(scale, zero)


def grid_codes(values: torch.Tensor, grid: IntGrid, bits: int) -> torch.Tensor:
    return (torch.round(values.float() / grid.scale) + grid.zero).clamp(0, 2**bits - 1).to(torch.uint8)


def grid_values(codes: torch.Tensor, grid: IntGrid) -> torch.Tensor:
    """``(code - z) · s`` rounded once to bfloat16 (returned as float32): the weight a bf16 model computes with,
    and exactly what compressed-tensors' bf16 dequantisation produces."""
    return ((codes.float() - grid.zero) * grid.scale).to(SCALE_DTYPE).float()


def _grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    if weight.shape[-1] % group_size:
        raise ValueError(f"the input dimension {weight.shape[-1]} is not a multiple of the group size {group_size}")
    return weight.reshape(*weight.shape[:-1], -1, group_size)


def quantize_int(
    weight: torch.Tensor, bits: int, group_size: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``weight`` ``[..., K]`` → (packed codes uint8 ``[..., K·bits/8]``, bf16 scales ``[..., K/G]``, uint8 zero
    points ``[..., K/G]`` or None when symmetric)."""
    groups = _grouped(weight, group_size)
    grid = group_grid(groups, bits, symmetric)
    codes = grid_codes(groups, grid, bits).reshape(weight.shape)
    zeros = None if symmetric else grid.zero.squeeze(-1).to(torch.uint8)
    return pack_codes(codes, bits), grid.scale.squeeze(-1).to(SCALE_DTYPE), zeros


def dequantize_int(
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The inverse of :func:`quantize_int`: ``[..., K]`` values in ``dtype``."""
    codes = unpack_codes(packed, bits)
    groups = _grouped(codes, group_size)
    zero = torch.full_like(scales, 2 ** (bits - 1), dtype=torch.float32) if zeros is None else zeros.float()
    grid = IntGrid(scales.float().unsqueeze(-1), zero.unsqueeze(-1))
    return grid_values(groups, grid).reshape(codes.shape).to(dtype)
