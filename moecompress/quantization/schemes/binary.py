"""Binary weights: one sign bit per weight and a bf16 scale per group."""

from __future__ import annotations

from ...kernels import binary, dequant
from .base import SchemeKind, register


@register
class Binary(SchemeKind):
    name = "binary"
    bits = 1
    group_sizes = binary.GROUP_SIZES
    default_group_size = 128
    """16-bit scales per 32 weights would cost half a bit per weight."""
    scale_dtype = binary.SCALE_DTYPE
    label = "sign-bit (binary)"

    def fit(self, scheme, groups, exclude):
        return binary.group_scales(groups, exclude)

    def codes(self, scheme, values, grid):
        return binary.sign_codes(values)

    def values(self, scheme, codes, grid):
        return binary.sign_values(codes, grid)

    def dequantize_fast(self, q, dtype, salient):
        return dequant.binary(q.packed, q.scales, q.scheme.group_size, tuple(q.shape), dtype, salient)

    def triton_linear(self, module, x, bias, salient):
        from ...kernels.triton_binary import binary_linear
        from ..dispatch import binary_correction, cached

        correction = cached(module, ("binary", x.device), lambda: binary_correction(module)) if salient else None
        return binary_linear(
            x, module.weight.data, module.weight_scales.data, module.scheme.group_size, correction, bias
        )

    def ggml_type(self, scheme, has_zeros):
        return "Q4_0"

    def ggml_quants(self, scheme, codes, type_name):
        return codes * 2 + 7
