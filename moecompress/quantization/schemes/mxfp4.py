"""MXFP4 (OCP): E2M1 codes in 32-wide blocks with an E8M0 (power-of-two) scale."""

from __future__ import annotations

import torch

from ...kernels import dequant, mxfp4, mxfp4_fused
from .base import SchemeKind, register


@register
class MXFP4(SchemeKind):
    name = "mxfp4"
    bits = 4
    group_sizes = (mxfp4.BLOCK_SIZE,)
    default_group_size = mxfp4.BLOCK_SIZE
    fixed_group_size = mxfp4.BLOCK_SIZE
    settings = frozenset({"scale_rule"})
    scale_dtype = torch.uint8
    label = "MXFP4"
    formats = frozenset({"native", "gpt-oss", "compressed-tensors"})
    compressed_tensors_format = "mxfp4-pack-quantized"
    number_type = "float"
    cpu_matmul = "mxfp4"
    triton_moe = True

    def check(self, scheme) -> None:
        if scheme.group_size != mxfp4.BLOCK_SIZE:
            raise ValueError(f"MXFP4 blocks are {mxfp4.BLOCK_SIZE} wide, not {scheme.group_size}")

    def describe(self, scheme) -> str:
        return f"mxfp4 (scale rule {scheme.scale_rule}"

    def fit(self, scheme, groups, exclude):
        if exclude is not None:
            groups = groups.masked_fill(exclude, 0.0)
        return mxfp4.block_exponents(groups, scheme.scale_rule).unsqueeze(-1)

    def codes(self, scheme, values, grid):
        return mxfp4.e2m1_codes(values.float() * mxfp4.power_of_two(-grid))

    def values(self, scheme, codes, grid):
        return mxfp4.e2m1_values(codes) * mxfp4.power_of_two(grid)

    def pack_grid(self, scheme, grid):
        return (grid.squeeze(-1) + mxfp4.E8M0_BIAS).to(torch.uint8), None

    def unpack_grid(self, scheme, scales, zeros):
        return (scales.to(torch.int32) - mxfp4.E8M0_BIAS).unsqueeze(-1)

    def quantize_fast(self, scheme, weight):
        if not mxfp4_fused.available():
            return None
        return mxfp4_fused.quantize_mxfp4(weight, scheme.scale_rule)

    def dequantize_fast(self, q, dtype, salient):
        return dequant.mxfp4(q.packed, q.scales, tuple(q.shape), dtype, salient)

    def triton_linear(self, module, x, bias, salient):
        if salient:
            return None
        from ...kernels.triton_mxfp4 import mxfp4_linear

        return mxfp4_linear(x, module.weight.data, module.weight_scales.data, bias)

    def ggml_type(self, scheme, has_zeros):
        return "MXFP4"
