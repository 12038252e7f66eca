"""The plugin's CPU forward: the fused dequantise-and-multiply kernels compute what dequantising and ``F.linear``
compute, and the experts module routes through them or the packed-INT4 matmul only where they apply (few tokens,
4-bit codes, no salient weights, no gradient), giving the reference forward's output either way."""

import pytest
import torch
import torch.nn.functional as F

from moecompress.kernels import cpu_matmul, int4pack
from moecompress.quantization import cpu_forward
from moecompress.quantization.modules import QuantizedExperts
from moecompress.quantization.scheme import QuantScheme

pytest.importorskip("numba")

SCHEMES = {
    "mxfp4": QuantScheme("mxfp4"),
    "int4-g32": QuantScheme("int4", group_size=32),
    "int4-g128": QuantScheme("int4", group_size=128),
    "int4-asym": QuantScheme("int4", group_size=64, symmetric=False),
    "w4a8": QuantScheme("w4a8", group_size=32),
}


def _fused(scheme: QuantScheme, quantized, x: torch.Tensor) -> torch.Tensor:
    if scheme.is_float:
        return cpu_matmul.mxfp4_linear(x, quantized.packed, quantized.scales)
    return cpu_matmul.int4_linear(x, quantized.packed, quantized.scales, quantized.zeros, scheme.group_size)


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
def test_fused_kernel_equals_dequantise_then_linear(name, tokens):
    scheme = SCHEMES[name]
    torch.manual_seed(tokens)
    weight = torch.randn(70, 256) * torch.logspace(-3, 1, 256)  # blocks of very different magnitudes
    quantized = scheme.quantize(weight)
    x = torch.randn(tokens, 256)
    expected = F.linear(x, quantized.dequantize(torch.float32))
    torch.testing.assert_close(_fused(scheme, quantized, x), expected, rtol=1e-5, atol=1e-5)


def test_mxfp4_kernel_decodes_every_code_at_extreme_scales():
    scheme = SCHEMES["mxfp4"]
    codes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)  # every byte: every pair of codes
    scales = torch.tensor([0, 1, 2, 100, 127, 200, 251, 252], dtype=torch.uint8).unsqueeze(1).repeat(1, 2)
    from moecompress.quantization.scheme import QuantizedTensor

    quantized = QuantizedTensor(scheme, (8, 64), codes, scales)
    dense = quantized.dequantize(torch.float32)
    for column in range(64):
        x = torch.zeros(1, 64)
        x[0, column] = 1.0
        assert torch.equal(cpu_matmul.mxfp4_linear(x, codes, scales)[0], dense[:, column])


def test_bf16_inputs_give_bf16_outputs_close_to_the_bf16_matmul():
    scheme = SCHEMES["mxfp4"]
    torch.manual_seed(0)
    quantized = scheme.quantize(torch.randn(96, 128))
    x = torch.randn(2, 128).bfloat16()
    out = cpu_matmul.mxfp4_linear(x, quantized.packed, quantized.scales)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x, quantized.dequantize(torch.bfloat16)))


def _silu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _experts(scheme: QuantScheme, ranks: dict | None = None) -> QuantizedExperts:
    torch.manual_seed(2)
    experts, hidden, inter = 6, 128, 64
    module = QuantizedExperts(experts, hidden, inter, scheme, _silu, dtype=torch.bfloat16, ranks=ranks)
    stored = {
        **scheme.quantize(torch.randn(experts, 2 * inter, hidden) * 0.1).stored("gate_up_proj"),
        **scheme.quantize(torch.randn(experts, hidden, inter) * 0.1).stored("down_proj"),
    }
    for name, tensor in stored.items():
        getattr(module, name).data.copy_(tensor)
    for parameter in module.lowrank.parameters():
        parameter.data.copy_(torch.randn_like(parameter) * 0.05)
    return module


def _routing(tokens: int, experts: int = 6, top_k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    return ids, torch.rand(tokens, top_k, generator=generator).softmax(-1)


def _record_calls(monkeypatch, owner, function_name: str) -> list[int]:
    calls = []
    original = getattr(owner, function_name)
    monkeypatch.setattr(owner, function_name, lambda x, *rest: calls.append(x.shape[0]) or original(x, *rest))
    return calls


@pytest.mark.parametrize("name", ["mxfp4", "int4-g32", "int4-asym", "w4a8"])
@pytest.mark.parametrize("tokens", [1, 5, 12, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_forward_equals_the_reference(monkeypatch, name, tokens, dtype):
    """Decode (1 token), a short prefill (most experts within the fast routes' token limits) and a longer one
    (dequantise then matmul), with low-rank adapters, against ``MOECOMPRESS_KERNELS=reference``: bf16 inputs go
    through the packed-INT4 matmul, float32 ones through the fused numba kernel."""
    module = _experts(SCHEMES[name], ranks={"gate": [2, 0, 3, 0, 1, 0], "down": [0, 4, 0, 0, 0, 2]})
    hidden = torch.randn(tokens, 128).to(dtype)
    ids, weights = _routing(tokens)
    fused = _record_calls(monkeypatch, cpu_matmul, "mxfp4_linear" if SCHEMES[name].is_float else "int4_linear")
    repacked = _record_calls(monkeypatch, int4pack, "linear")
    with torch.inference_mode():
        out = module(hidden, ids, weights)
        monkeypatch.setenv("MOECOMPRESS_KERNELS", "reference")
        expected = module(hidden, ids, weights)
    kind = "mxfp4" if name == "mxfp4" else "int4"
    limit = (cpu_forward.REPACKED_MAX_TOKENS if dtype == torch.bfloat16 else cpu_forward.FUSED_MAX_TOKENS)[kind]
    counts = torch.bincount(ids.flatten(), minlength=6)
    expected_calls = sorted(2 * [int(n) for n in counts if 0 < n <= limit])  # gate_up and down each
    assert (sorted(repacked), sorted(fused)) == (
        (expected_calls, []) if dtype == torch.bfloat16 else ([], expected_calls)
    )
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    if name == "w4a8" and dtype == torch.bfloat16:
        tolerance = 5e-2  # the int8 activations turn a bf16 rounding difference upstream into a whole step
    torch.testing.assert_close(out.float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_repacked_copy_is_kept_off_the_state_dict_and_follows_replaced_codes(monkeypatch):
    module = _experts(SCHEMES["int4-g32"])
    keys = set(module.state_dict())
    ids, weights = _routing(1)
    hidden = torch.randn(1, 128).bfloat16()
    with torch.inference_mode():
        before = module(hidden, ids, weights)
        assert set(module.state_dict()) == keys
        module.gate_up_proj = torch.nn.Parameter(module.gate_up_proj.data ^ 0x11, requires_grad=False)
        after = module(hidden, ids, weights)
        monkeypatch.setenv("MOECOMPRESS_KERNELS", "reference")
        expected = module(hidden, ids, weights)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_repack_can_be_turned_off(monkeypatch):
    module = _experts(SCHEMES["mxfp4"])
    monkeypatch.setenv("MOECOMPRESS_CPU_REPACK", "0")
    monkeypatch.setattr(int4pack, "linear", lambda *args: pytest.fail("repacked route with MOECOMPRESS_CPU_REPACK=0"))
    ids, weights = _routing(1)
    with torch.inference_mode():
        module(torch.randn(1, 128).bfloat16(), ids, weights)
    assert "_repacked" not in module.__dict__


def test_gradients_and_salient_weights_take_the_reference(monkeypatch):
    module = _experts(SCHEMES["mxfp4"])
    x = torch.randn(2, 128, requires_grad=True)
    assert not cpu_forward.fused_ready(module, x)
    assert cpu_forward.fused_ready(module, x.detach())
    monkeypatch.setattr(cpu_matmul, "mxfp4_linear", lambda *args: pytest.fail("fused kernel under autograd"))
    monkeypatch.setattr(int4pack, "linear", lambda *args: pytest.fail("packed-INT4 matmul under autograd"))
    ids, weights = _routing(2)
    module(x, ids, weights).float().sum().backward()
    assert x.grad is not None
    module._salient_shapes["down_proj"] = (6, 128, 64)
    assert cpu_forward.expert_linear(module, "down_proj", 0, torch.randn(1, 64)) is None


def test_binary_and_int2_are_not_fused():
    for scheme in (QuantScheme("binary", group_size=64), QuantScheme("int2", group_size=32)):
        module = QuantizedExperts(2, 64, 32, scheme, _silu)
        assert not cpu_forward.fused_ready(module, torch.zeros(1, 64))
