"""torch's packed-INT4 CPU matmul as the plugin uses it: our codes repacked into its tiled layout, MXFP4 written
as two 4-bit halves, and the product equal to dequantise + ``F.linear`` within bf16 rounding."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moecompress.kernels import int4pack, mxfp4
from moecompress.kernels.packing import pack_codes
from moecompress.quantization.scheme import QuantizedTensor, QuantScheme

pytestmark = pytest.mark.skipif(not int4pack.available(), reason="torch has no packed-INT4 CPU matmul")


def _repacked(scheme: QuantScheme, quantized: QuantizedTensor) -> int4pack.Int4Packed:
    if scheme.is_float:
        return int4pack.from_mxfp4(quantized.packed, quantized.scales)
    return int4pack.from_int4(quantized.packed, quantized.scales, quantized.zeros, scheme.group_size)


@pytest.mark.parametrize("rows", [64, 192])
def test_tiled_layout_is_torchs(rows):
    codes = torch.randint(0, 16, (rows, 256), generator=torch.Generator().manual_seed(rows), dtype=torch.int32)
    expected = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert np.array_equal(int4pack.tiled(pack_codes(codes, 4).numpy()), expected.numpy())


def test_mxfp4_halves_sum_to_every_e2m1_value():
    for code, value in enumerate(mxfp4.E2M1_VALUES.tolist()):
        low, high = int4pack._E2M1_LOW[code] - 8, int4pack._E2M1_HIGH[code] - 8
        assert low / 2 + high == value and -8 <= low <= 7 and -8 <= high <= 7
    pairs = np.arange(256, dtype=np.uint8)
    low, high = int4pack._mxfp4_halves(pairs)
    for table, got in ((int4pack._E2M1_LOW, low), (int4pack._E2M1_HIGH, high)):
        assert np.array_equal(got, [table[b & 15] | table[b >> 4] << 4 for b in range(256)])


SCHEMES = {
    "mxfp4": QuantScheme("mxfp4"),
    "int4-g32": QuantScheme("int4", group_size=32),
    "int4-g128": QuantScheme("int4", group_size=128),
    "int4-asym-g64": QuantScheme("int4", group_size=64, symmetric=False),
}


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("rows", [128, 96])  # 96: not whole tiles, torch's own converter
@pytest.mark.parametrize("tokens", [1, 3, 8, 20])
def test_product_equals_dequantise_then_linear_within_bf16_rounding(name, rows, tokens):
    """Bound: ``2⁻⁸ · |x|·|W|ᵀ`` from the exact product of the reference's weights. MXFP4's weights are exact in
    both and only the output's rounding to bf16 and the summation order differ; INT4's reference rounds each
    weight to bf16 (the op does not), and an asymmetric zero ``(8 - z) · s`` is rounded to bf16 here: each at most
    2⁻⁹ of a weight's magnitude (or its offset's, at most the group's largest), so within the bound."""
    scheme = SCHEMES[name]
    torch.manual_seed(tokens + rows)
    quantized = scheme.quantize(torch.randn(rows, 256) * torch.logspace(-3, 1, 256))
    x = torch.randn(tokens, 256).bfloat16()
    weight = quantized.dequantize(torch.float32).double()
    exact = x.double() @ weight.T
    bound = 2.0**-8 * (x.double().abs() @ weight.abs().T) + 1e-30
    out = int4pack.linear(x, _repacked(scheme, quantized))
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, rows)
    assert ((out.double() - exact).abs() <= bound).all()
    if scheme.is_float:
        reference = F.linear(x, quantized.dequantize(torch.bfloat16))
        torch.testing.assert_close(out, reference, rtol=2**-7, atol=1e-6)


def test_mxfp4_decodes_every_code_at_extreme_scales_exactly():
    codes = torch.arange(256, dtype=torch.uint8).reshape(8, 32).repeat(8, 1)  # every pair of codes
    exponents = torch.tensor([0, 1, 2, 100, 127, 200, 251, 252], dtype=torch.uint8)
    scales = exponents.repeat_interleave(8).unsqueeze(1).repeat(1, 2)
    dense = QuantizedTensor(QuantScheme("mxfp4"), (64, 64), codes, scales).dequantize(torch.float32)
    columns = int4pack.linear(torch.eye(64).bfloat16(), int4pack.from_mxfp4(codes, scales)).float().T
    assert torch.equal(columns, dense)


def test_symmetric_int4_decodes_every_code_exactly():
    codes = torch.arange(16, dtype=torch.uint8).repeat(64, 8)  # [64, 128]
    scales = torch.logspace(-6, 3, 64 * 4).bfloat16().reshape(64, 4)
    quantized = QuantizedTensor(QuantScheme("int4", group_size=32), (64, 128), pack_codes(codes, 4), scales)
    columns = int4pack.linear(torch.eye(128).bfloat16(), _repacked(quantized.scheme, quantized)).float().T
    exact = (codes.float() - 8) * scales.float().repeat_interleave(32, dim=1)
    assert torch.equal(columns, exact.bfloat16().float())
