"""Binary weights: one sign bit per weight and one bfloat16 scale ``α`` per group of ``G`` weights along the input
dimension, so a weight is ``+α`` (code 1) or ``-α`` (code 0).

``α`` is the mean absolute value of the group's weights, the least-squares scale for fixed signs. Weights kept
exactly elsewhere (salient weights, see :mod:`moecompress.quantization.salient`) are left out of that mean: the
scale then fits only the weights the signs must represent.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.bfloat16
GROUP_SIZES = (32, 64, 128, 256)


def group_scales(groups: torch.Tensor, exclude: torch.Tensor | None = None) -> torch.Tensor:
    """``α`` of each group in ``groups`` ``[..., G]`` as float32 ``[..., 1]`` (the value of the stored bf16).

    ``exclude`` (bool, same shape) marks weights left out of the mean; a group with nothing left gets ``α = 0``.
    """
    magnitude = groups.float().abs()
    if exclude is None:
        mean = magnitude.mean(dim=-1, keepdim=True)
    else:
        keep = ~exclude
        count = keep.sum(dim=-1, keepdim=True)
        total = (magnitude * keep).sum(dim=-1, keepdim=True)
        mean = torch.where(count > 0, total / count.clamp_min(1), torch.zeros_like(total))
    return mean.to(SCALE_DTYPE).float()


def sign_codes(values: torch.Tensor) -> torch.Tensor:
    """uint8 codes: 1 where ``values >= 0``."""
    return (values >= 0).to(torch.uint8)


def sign_values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``±α`` for ``codes`` (broadcast against ``scales``)."""
    return torch.where(codes.bool(), scales, -scales)
