"""Sub-byte packing: ``8 // bits`` unsigned codes per byte along the last dimension, element ``j`` of each byte's
group in bits ``j*bits .. j*bits+bits-1`` (so for 4-bit codes the even element sits in the low nibble, as MXFP4
and gpt-oss require).
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (1, 2, 4, 8)


def _per_byte(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"cannot pack {bits}-bit codes; supported: {SUPPORTED_BITS}")
    return 8 // bits


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-wide codes (any integer dtype, values < 2**bits) into uint8 along the last dim."""
    per_byte = _per_byte(bits)
    if codes.shape[-1] % per_byte:
        raise ValueError(f"last dimension {codes.shape[-1]} is not a multiple of {per_byte}")
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, per_byte)
    packed = torch.zeros(grouped.shape[:-1], dtype=torch.uint8, device=codes.device)
    for j in range(per_byte):
        packed |= grouped[..., j] << (j * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes`: uint8 codes, ``8 // bits`` times as many along the last dim."""
    per_byte = _per_byte(bits)
    mask = (1 << bits) - 1
    parts = [(packed >> (j * bits)) & mask for j in range(per_byte)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)
