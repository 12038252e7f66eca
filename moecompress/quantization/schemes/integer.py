"""Group-wise integers (INT4, INT2) and W4A8 (INT4 weights, int8 per-token activations at inference)."""

from __future__ import annotations

import torch

from ...kernels import dequant, intq
from .base import SchemeKind, register


class IntegerKind(SchemeKind):
    group_sizes = intq.GROUP_SIZES
    settings = frozenset({"symmetric"})
    scale_dtype = intq.SCALE_DTYPE
    formats = frozenset({"native", "compressed-tensors"})
    compressed_tensors_format = "pack-quantized"

    def stores_zeros(self, scheme) -> bool:
        return not scheme.symmetric

    def describe(self, scheme) -> str:
        kind = "symmetric" if scheme.symmetric else "asymmetric"
        extra = ", int8 per-token activations" if self.activation_bits else ""
        return f"{self.name} (group {scheme.group_size}, {kind}{extra}"

    def fit(self, scheme, groups, exclude):
        if exclude is not None:
            groups = groups.masked_fill(exclude, 0.0)
        return intq.group_grid(groups, self.bits, scheme.symmetric)

    def codes(self, scheme, values, grid):
        return intq.grid_codes(values, grid, self.bits)

    def values(self, scheme, codes, grid):
        return intq.grid_values(codes, grid)

    def pack_grid(self, scheme, grid):
        scales = grid.scale.squeeze(-1).to(intq.SCALE_DTYPE)
        return scales, None if scheme.symmetric else grid.zero.squeeze(-1).to(torch.uint8)

    def unpack_grid(self, scheme, scales, zeros):
        zero = (
            torch.full(scales.shape, 2 ** (self.bits - 1), dtype=torch.float32, device=scales.device)
            if zeros is None
            else zeros.float()
        )
        return intq.IntGrid(scales.float().unsqueeze(-1), zero.unsqueeze(-1))

    def stack_grids(self, grids):
        return intq.IntGrid(torch.cat([g.scale for g in grids], dim=-2), torch.cat([g.zero for g in grids], dim=-2))

    def dequantize_fast(self, q, dtype, salient):
        return dequant.integer(
            q.packed, q.scales, q.zeros, self.bits, q.scheme.group_size, tuple(q.shape), dtype, salient
        )

    def ggml_type(self, scheme, has_zeros):
        return "Q4_1" if has_zeros else "Q4_0"

    def ggml_quants(self, scheme, codes, type_name):
        return codes.to(torch.int16) - 2 ** (self.bits - 1) + 8 if type_name == "Q4_0" else codes


@register
class INT4(IntegerKind):
    name = "int4"
    bits = 4
    cpu_matmul = "int4"


@register
class INT2(IntegerKind):
    name = "int2"
    bits = 2
    default_symmetric = False
    """A zero-centred 2-bit grid wastes a level."""


@register
class W4A8(INT4):
    name = "w4a8"
    activation_bits = 8
    compressed_tensors_format = "int-quantized"

    def triton_linear(self, module, x, bias, salient):
        if salient:
            return None
        from ...kernels.triton_w4a8 import w4a8_linear_triton

        zeros = getattr(module, "weight_zeros", None)
        zeros = None if zeros is None else zeros.data
        return w4a8_linear_triton(
            x, module.weight.data, module.weight_scales.data, zeros, module.scheme.group_size, bias
        )
