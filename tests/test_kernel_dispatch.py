"""The plugin modules choose the torch reference off CUDA, and what dispatch hands the kernels (packed experts,
padded adapters, the salient correction) computes what the module computes."""

import pytest
import torch
import torch.nn.functional as F

from moecompress.families.base import FamilyAdapter
from moecompress.families.gpt_oss import GptOssAdapter
from moecompress.kernels import triton_support
from moecompress.quantization import dispatch
from moecompress.quantization.modules import QuantizedExperts, QuantizedLinear
from moecompress.quantization.scheme import QuantScheme

triton = pytest.importorskip("triton")


def _load(module, stored: dict[str, torch.Tensor]) -> None:
    for name, tensor in stored.items():
        getattr(module, name).data.copy_(tensor)


def _linear(scheme: QuantScheme, salient: float = 0.0, seed: int = 0) -> QuantizedLinear:
    torch.manual_seed(seed)
    weight = torch.randn(48, 128)
    keep = None
    if salient:
        keep = torch.zeros(48, 128, dtype=torch.bool)
        keep.view(-1)[torch.randperm(48 * 128)[: int(salient * 48 * 128)]] = True
    quantized = scheme.quantize(weight, keep)
    stored = quantized.stored("weight")
    sizes = {"weight": (stored["weight_salient"].numel(), quantized.salient.count)} if salient else None
    module = QuantizedLinear(128, 48, True, scheme, torch.bfloat16, salient=sizes)
    _load(module, stored)
    module.bias.data.copy_(torch.randn(48))
    return module


@pytest.mark.parametrize(
    "scheme",
    [QuantScheme("mxfp4"), QuantScheme("w4a8", symmetric=False), QuantScheme("binary", group_size=64)],
    ids=["mxfp4", "w4a8", "binary"],
)
def test_linear_uses_the_reference_on_cpu_and_equals_it(scheme):
    module = _linear(scheme)
    x = torch.randn(3, 128).bfloat16()
    assert dispatch.linear(module, x) is None
    weight = module.quantized("weight", (48, 128)).dequantize(x.dtype)
    expected = F.linear(module._inputs(x), weight, module.bias.to(x.dtype))
    assert torch.equal(module(x), expected)


def test_the_reference_switch_turns_kernels_off(monkeypatch):
    x = torch.zeros(1)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert triton_support.use_kernels(x)
    monkeypatch.setenv("MOECOMPRESS_KERNELS", "reference")
    assert not triton_support.use_kernels(x)


def test_binary_salient_correction_reproduces_the_dequantised_matrix():
    from moecompress.kernels.triton_binary import binary_dequantize

    module = _linear(QuantScheme("binary", group_size=64, salient_fraction=0.02), salient=0.02)
    correction = dispatch.binary_correction(module)
    assert correction.count == module._salient("weight", None).count > 0
    rebuilt = binary_dequantize(module.weight.data, module.weight_scales.data, 64)
    rebuilt[correction.rows.long(), correction.cols.long()] += correction.deltas
    assert torch.equal(rebuilt, module.quantized("weight", (48, 128)).dequantize())
    starts = correction.row_start.long()
    assert starts[0] == 0 and starts[-1] == correction.count
    for row in (0, 17, 47):
        assert (correction.rows[starts[row] : starts[row + 1]] == row).all()


class _Family(FamilyAdapter):
    family = "test"
    model_types = ()


_GptOss = GptOssAdapter


def test_kernel_activation_recognises_the_family_activations_only():
    from moecompress.kernels.triton_moe import Activation

    assert dispatch.kernel_activation(_Family({"hidden_act": "silu"}).activation) == Activation("silu")
    assert dispatch.kernel_activation(_Family({"hidden_act": "gelu"}).activation) is None
    oss = dispatch.kernel_activation(_GptOss({"swiglu_limit": 5.0}).activation)
    assert oss == Activation("swigluoai", 1.702, 5.0)
    assert dispatch.kernel_activation(lambda gate, up: gate * up) is None
    gate, up = torch.randn(4, 8) * 4, torch.randn(4, 8) * 4
    torch.testing.assert_close(oss(gate, up), _GptOss({"swiglu_limit": 5.0}).activation(gate, up))


def _experts(activation, *, bias: bool, ranks: dict | None) -> QuantizedExperts:
    torch.manual_seed(1)
    experts, hidden, inter = 4, 64, 32
    scheme = QuantScheme("mxfp4")
    module = QuantizedExperts(
        experts, hidden, inter, scheme, activation, has_bias=bias, dtype=torch.float32, ranks=ranks
    )
    _load(module, scheme.quantize(torch.randn(experts, 2 * inter, hidden) * 0.1).stored("gate_up_proj"))
    _load(module, scheme.quantize(torch.randn(experts, hidden, inter) * 0.1).stored("down_proj"))
    for parameter in module.parameters():
        if parameter.dtype == torch.float32:
            parameter.data.copy_(torch.randn_like(parameter) * 0.1)
    return module


@pytest.mark.parametrize(
    ("bias", "ranks"),
    [(False, None), (True, {"gate": [3, 0, 5, 0], "up": [0, 0, 2, 0], "down": [0, 4, 0, 0]})],
    ids=["plain", "bias-and-adapters"],
)
def test_mxfp4_experts_packing_computes_what_the_module_computes(bias, ranks):
    from moecompress.kernels.triton_moe import fused_moe_reference

    family = _Family({"hidden_act": "silu"})
    module = _experts(family.activation, bias=bias, ranks=ranks)
    torch.manual_seed(2)
    hidden = torch.randn(7, 64)
    ids = torch.randint(0, 3, (7, 2))
    weights = torch.rand(7, 2)
    assert dispatch.experts(module, hidden.bfloat16(), ids, weights) is None
    prepared = dispatch.mxfp4_experts(module)
    if ranks:
        assert prepared.gate.rank == prepared.up.rank == 16 and prepared.down_adapter.rank == 16
    expected = module(hidden, ids, weights)
    actual = fused_moe_reference(hidden, ids, weights, prepared, dispatch.kernel_activation(family.activation))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
