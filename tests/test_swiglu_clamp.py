"""Experts whose SwiGLU is clamped with a limit per layer (Step-3.7-Flash, Ling 2.5): each layer's activation is the
stock module's, every user of the activation (the view, GPTQ's and the low-rank inputs, the plugin's
QuantizedExperts) follows the layer, and the exports that cannot write a per-layer clamp refuse in one line."""

import pytest
import torch
import torch.nn.functional as F
from helpers import checkpoint_adapter, load_stock, run_cli
from synthetic import save_tiny_model

from moecompress import quantization
from moecompress.checkpoint import CheckpointReader
from moecompress.checkpoint.stream import group_keys_by_layer
from moecompress.export.imatrix import layer_statistics
from moecompress.families import adapter_for
from moecompress.families.swiglu_clamp import ClampedSwiGLU
from moecompress.passes.expert_merge import _intermediate
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint
from moecompress.quantization.compensation import output_reach
from moecompress.quantization.experts import quantize_experts_calibrated, quantize_experts_rtn, routed_inputs
from moecompress.quantization.scheme import QuantScheme

FAMILIES = ("step3p7", "bailing_hybrid")
CLAMPED = {"step3p7": 2, "bailing_hybrid": 1}
"""The MoE layer of each tiny config whose limit is set (the other MoE layer's is 0: unclamped)."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("clamped")
    return {family: save_tiny_model(family, root / family) for family in FAMILIES}


def _views(directory, adapter):
    with CheckpointReader(directory) as reader:
        keys, _ = group_keys_by_layer(reader, adapter)
        return {layer: adapter.split_layer(layer, reader.read(keys[layer]))[0] for layer in adapter.moe_layers()}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_layer_computes_its_stock_experts_clamp_included(checkpoints, family):
    directory = checkpoints[family]
    adapter, model = checkpoint_adapter(directory), load_stock(directory)
    assert adapter.activation_varies()
    hidden = torch.randn(48, 64, generator=torch.Generator().manual_seed(0))
    for layer, moe in _views(directory, adapter).items():
        stock_module = adapter.experts_of(model, layer)
        assert moe.layer == layer and adapter.activation_of(layer) == ClampedSwiGLU(stock_module.limit)
        projected = F.linear(hidden, moe.gate_up[0])
        torch.testing.assert_close(
            adapter.expert_hidden(projected, moe.intermediate_size, layer),
            stock_module._apply_gate(projected),
            rtol=0,
            atol=0,
        )
        _, weights, ids = adapter.stock_route(model, layer, hidden)
        stock = adapter.stock_experts(model, layer, hidden, ids, weights)
        view = adapter.combine_experts(
            hidden, ids, weights, lambda expert, x, m=moe: adapter.expert_output(m, expert, x)
        )
        torch.testing.assert_close(view, stock, rtol=1e-5, atol=1e-5)
        unclamped = adapter.activation(*projected.chunk(2, dim=-1))
        differs = not torch.equal(unclamped, stock_module._apply_gate(projected))
        assert differs == (layer == CLAMPED[family]), (layer, stock_module.limit)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_activation_without_its_layer_is_refused_where_the_clamp_varies(family):
    from synthetic import tiny_config

    adapter = adapter_for(tiny_config(family).to_dict())
    with pytest.raises(ValueError, match="depends on the layer"):
        adapter.activation_of(None)
    plain = adapter_for(tiny_config("qwen3_moe").to_dict())
    assert plain.activation_of(None) == plain.activation and plain.activation_of(1) == plain.activation


def test_gptq_imatrix_and_merge_see_the_stock_clamped_activations(checkpoints, monkeypatch):
    """The down projection's inputs that GPTQ (through the quantised gate/up), the imatrix and expert merging compute
    are what the stock experts module computes in the clamped layer."""
    directory = checkpoints["bailing_hybrid"]
    adapter, model, layer = checkpoint_adapter(directory), load_stock(directory), CLAMPED["bailing_hybrid"]
    moe = _views(directory, adapter)[layer]
    stock = adapter.experts_of(model, layer)
    hidden = torch.randn(256, 64, generator=torch.Generator().manual_seed(3))
    inputs = routed_inputs(adapter, moe, hidden)
    expected = [stock._apply_gate(F.linear(x, moe.gate_up[e].float())) for e, x in enumerate(inputs)]
    sums = layer_statistics(adapter, layer, moe, hidden)[f"blk.{layer}.ffn_down_exps.weight.in_sum2"]
    for expert, activation in enumerate(expected):
        assert torch.equal(_intermediate(adapter, moe, expert, inputs[expert]), activation)
        torch.testing.assert_close(sums[expert], activation.double().pow(2).sum(dim=0))
    seen = []
    real = quantization.experts._quantize_matrix

    def record(weight, matrix_inputs, *args):
        seen.append(matrix_inputs)
        return real(weight, matrix_inputs, *args)

    monkeypatch.setattr(quantization.experts, "_quantize_matrix", record)
    quantized = quantize_experts_calibrated(adapter, moe, hidden, QuantScheme("int4", 32), min_tokens=1)
    for expert, x in enumerate(inputs):
        gate_up = quantized.gate_up[expert].dequantize()
        torch.testing.assert_close(seen[1][expert], stock._apply_gate(F.linear(x, gate_up)), rtol=0, atol=0)
    assert any(
        not torch.equal(a, adapter.activation(*F.linear(x, moe.gate_up[e]).chunk(2, -1)))
        for e, (a, x) in enumerate(zip(expected, inputs, strict=True))
        if x.shape[0]
    )


def test_the_low_rank_reach_follows_the_layers_clamp(checkpoints):
    """The low-rank compensation's gain of a gate/up error is measured through the clamped activation: a clamp
    that saturates every gate leaves a gate error no reach at all."""
    directory = checkpoints["step3p7"]
    adapter = checkpoint_adapter(directory)
    moe = _views(directory, adapter)[CLAMPED["step3p7"]]
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    projected = F.linear(x, moe.gate_up[0].float())
    error = 1e-3 * torch.randn(moe.intermediate_size, 64, generator=torch.Generator().manual_seed(2))
    saturated = projected.clone()
    saturated[:, : moe.intermediate_size] = 50.0
    clamped = output_reach(adapter, moe, 0, x, saturated, {"gate": error})
    unclamped = output_reach(adapter, moe.__class__(**{**moe.__dict__, "layer": 1}), 0, x, saturated, {"gate": error})
    assert clamped["gate"] == 0.0 and unclamped["gate"] > 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_mxfp4_output_computes_what_stock_computes_on_the_dequantised_weights(checkpoints, tmp_path, family):
    """Through the plugin, each layer's QuantizedExperts applies that layer's clamp: the logits equal stock
    transformers' on the source with every expert replaced by its dequantised weights."""
    import moecompress  # noqa: F401 - the plugin

    source = checkpoints[family]
    scheme = QuantScheme("mxfp4")
    quantize_checkpoint(source, tmp_path / "q", QuantizeConfig(scheme="mxfp4"), progress=False)
    quantized = load_stock(tmp_path / "q")
    adapter = checkpoint_adapter(source)
    reference = load_stock(source)
    for layer, moe in _views(source, adapter).items():
        experts = adapter.experts_of(quantized, layer)
        assert type(experts).__name__ == "QuantizedExperts"
        assert experts.activation == ClampedSwiGLU(adapter.swiglu_limit(layer))
        state = adapter.runtime_moe_state(quantize_experts_rtn(moe, scheme).dequantized())
        adapter.decoder_layers(reference)[layer].load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    ids = torch.randint(3, 380, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            quantized(input_ids=ids).logits, reference(input_ids=ids).logits, atol=2e-5, rtol=1e-5
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_exports_that_cannot_write_a_per_layer_clamp_refuse_in_one_line(checkpoints, tmp_path, family):
    source = checkpoints[family]
    result = run_cli("export", source, "--format", "gguf", "--out", tmp_path / "m.gguf")
    assert result.returncode == 2, result.stderr
    assert "clamp their SwiGLU with a limit per layer" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "m.gguf").exists()
    result = run_cli("quantize", source, "--out", tmp_path / "ct", "--scheme", "int4", "--format", "compressed-tensors")
    assert result.returncode == 2, result.stderr
    assert "limit per layer" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "ct").exists()


def test_the_fused_kernels_take_only_the_unclamped_layers():
    from moecompress.kernels.triton_moe import Activation
    from moecompress.quantization.dispatch import kernel_activation

    assert kernel_activation(ClampedSwiGLU(None)) == Activation("silu")
    assert kernel_activation(ClampedSwiGLU(7.0)) is None


def test_the_releases_names_are_read_and_classified(checkpoints):
    with CheckpointReader(checkpoints["step3p7"]) as reader:
        keys = set(reader.keys())
        stacked = reader.read(["model.layers.1.moe.gate_proj.weight"])["model.layers.1.moe.gate_proj.weight"]
    assert {
        "model.layers.1.moe.router_bias",
        "model.layers.1.share_expert.up_proj.weight",
        "vit_large_projector.weight",
    } <= keys
    assert tuple(stacked.shape) == (8, 32, 64)
    step = checkpoint_adapter(checkpoints["step3p7"])
    classes = {
        "model.layers.1.moe.up_proj.weight": "experts",
        "model.layers.1.moe.gate.weight": "router",
        "model.layers.1.moe.router_bias": "router",
        "model.layers.1.share_expert.down_proj.weight": "shared_experts",
        "vision_model.vit_downsampler1.weight": "vision",
    }
    assert {key: step.classify_key(key) for key in classes} == classes
    with CheckpointReader(checkpoints["bailing_hybrid"]) as reader:
        keys = set(reader.keys())
    assert {
        "model.word_embeddings.weight",
        "model.layers.1.attention.q_conv1d.weight",
        "model.layers.1.mlp.gate.expert_bias",
    } <= keys
    ling = checkpoint_adapter(checkpoints["bailing_hybrid"])
    assert ling.runtime_local_name("attention.dense.weight") == "self_attn.o_proj.weight"
    assert ling.runtime_local_name("attention.A_log") == "self_attn.forget_gate.A_log"
    assert ling.classify_key("model.layers.1.mlp.gate.expert_bias") == "router"
    assert ling.classify_key("model.word_embeddings.weight") == "embeddings"
