"""Nemotron-H: non-gated experts in the view, the quantised module, the release config's layer pattern, and Nemotron 3
Super's experts in a latent space (``moe_latent_size``)."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from helpers import layer_split, load_stock, plain_perplexity
from safetensors import safe_open
from safetensors.torch import load_file
from synthetic import build_tiny_model, save_tiny_model, save_tiny_source

from moecompress.checkpoint import CheckpointReader
from moecompress.cli.main import app
from moecompress.families import adapter_for
from moecompress.passes.expert_scores import brute_force_delta_h, layer_expert_stats
from moecompress.quantization.experts import quantize_experts_rtn
from moecompress.quantization.modules import QuantizedExperts
from moecompress.quantization.scheme import QuantScheme
from moecompress.sweep.engine import CalibrationSweep

ROOT = Path(__file__).resolve().parent.parent


def test_release_pattern_gives_the_layer_kinds():
    adapter = adapter_for({"model_type": "nemotron_h", "n_routed_experts": 8, "hybrid_override_pattern": "ME*-E"})
    assert adapter.num_layers == 5
    assert adapter.moe_layers() == [1, 4]
    assert [adapter.softmax_attention(i) for i in range(5)] == [False, False, True, False, False]


def test_view_holds_up_rows_and_writes_the_same_bytes(tmp_path):
    directory = save_tiny_model("nemotron_h", tmp_path / "model")
    tensors = load_file(directory / "model.safetensors")
    adapter = adapter_for(json.loads((directory / "config.json").read_text()))
    prefix = "backbone.layers.1."
    layer = {key: value for key, value in tensors.items() if key.startswith(prefix)}
    moe, rest, layout = adapter.split_layer(1, dict(layer))
    assert layout == "per_expert" and not moe.gated
    assert tuple(moe.gate_up.shape) == (8, 32, 64) and tuple(moe.down.shape) == (8, 64, 32)
    assert not any(".experts." in key for key in rest)
    written = adapter.join_layer(1, moe, rest, layout)
    assert written.keys() == layer.keys()
    assert all(torch.equal(written[key], layer[key]) for key in layer)


def test_expert_output_equals_the_stock_experts():
    model = build_tiny_model("nemotron_h")
    adapter = adapter_for(model.config.to_dict())
    experts = model.model.layers[1].mixer.experts
    moe = adapter.split_layer(
        1,
        {f"backbone.layers.1.{k}": v for k, v in model.model.layers[1].state_dict().items() if "experts." not in k}
        | {
            f"backbone.layers.1.mixer.experts.{e}.{name}.weight": getattr(experts, name)[e].detach()
            for e in range(8)
            for name in ("up_proj", "down_proj")
        },
    )[0]
    hidden = torch.randn(12, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 8, (12, 2), generator=torch.Generator().manual_seed(1))
    weights = torch.rand(12, 2, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        stock = experts(hidden, ids, weights)
        ours = adapter.combine_experts(hidden, ids, weights, lambda e, x: adapter.expert_output(moe, e, x))
    torch.testing.assert_close(ours, stock, rtol=1e-6, atol=1e-6)
    assert torch.equal(
        adapter.expert_output(moe, 3, hidden), F.linear(F.relu(F.linear(hidden, moe.gate_up[3])) ** 2, moe.down[3])
    )


def test_quantised_module_has_up_proj_and_computes_the_dequantised_expert(tmp_path):
    directory = save_tiny_model("nemotron_h", tmp_path / "model")
    adapter = adapter_for(json.loads((directory / "config.json").read_text()))
    tensors = load_file(directory / "model.safetensors")
    moe = adapter.split_layer(1, {k: v for k, v in tensors.items() if k.startswith("backbone.layers.1.")})[0]
    quantized = quantize_experts_rtn(moe, QuantScheme("mxfp4"))
    ranks = {"up": [2] + [0] * 7, "down": [0] * 8}
    module = QuantizedExperts(8, 64, 32, QuantScheme("mxfp4"), adapter.activation, ranks=ranks, gated=False)
    names = {name for name, _ in module.named_parameters()}
    assert {"up_proj", "up_proj_scales", "down_proj", "lowrank.0.up_L"} <= names and "gate_up_proj" not in names
    generator = torch.Generator().manual_seed(0)
    left, right = torch.randn(32, 2, generator=generator), torch.randn(2, 64, generator=generator)
    state = {**quantized.gate_up.stored("up_proj"), **quantized.down.stored("down_proj")}
    state.update({"lowrank.0.up_L": left, "lowrank.0.up_R": right})
    module.load_state_dict({k: v.to(module.state_dict()[k].dtype) for k, v in state.items()})
    dequantized = quantized.dequantized()
    up = dequantized.gate_up.clone()
    up[0] += left.bfloat16().float() @ right.bfloat16().float()
    reference = replace(dequantized, gate_up=up)
    hidden = torch.randn(10, 64, generator=generator)
    ids = torch.randint(0, 8, (10, 2), generator=generator)
    weights = torch.rand(10, 2, generator=generator)
    with torch.no_grad():
        ours = module(hidden, ids, weights)
    expected = adapter.combine_experts(hidden, ids, weights, lambda e, x: adapter.expert_output(reference, e, x))
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)


# ---- Nemotron 3 Super: the experts in a latent space (moe_latent_size) -------------------------------------------
@pytest.fixture(scope="module")
def latent(tmp_path_factory):
    directory = save_tiny_source("nemotron_h_latent", tmp_path_factory.mktemp("nemotron_latent") / "source")
    return directory


def test_latent_view_holds_latent_experts_and_keeps_the_projections_in_the_layer(latent):
    adapter, moe, rest, layout = layer_split(latent, 1)
    assert adapter.latent_experts and adapter.experts_width == 32
    assert (adapter.moe_site_module, adapter.router_input_module) == ("mixer.experts", "mixer.gate")
    assert tuple(moe.gate_up.shape) == (8, 96, 32) and tuple(moe.down.shape) == (8, 32, 96)
    assert tuple(moe.router_weight.shape) == (8, 64)
    projections = {key: tuple(rest[key].shape) for key in rest if "latent_proj" in key}
    assert projections == {
        "backbone.layers.1.mixer.fc1_latent_proj.weight": (32, 64),
        "backbone.layers.1.mixer.fc2_latent_proj.weight": (64, 32),
    }
    assert {adapter.classify_key(key) for key in projections} == {"other"}
    written = adapter.join_layer(1, moe.select([5, 2]), rest, layout)
    assert all(torch.equal(written[key], rest[key]) for key in projections)


def test_latent_view_and_output_projection_reproduce_the_stock_block(latent):
    adapter, moe, rest, _ = layer_split(latent, 1)
    block = load_stock(latent).model.layers[1].mixer
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock = block(hidden.unsqueeze(0))[0]
        latent_tokens = adapter.stock_experts_input(load_stock(latent), 1, hidden)
        routed = adapter.moe_forward(moe, latent_tokens, router_input=hidden)
        ours = block.fc2_latent_proj(routed) + block.shared_experts(hidden)
    torch.testing.assert_close(latent_tokens, F.linear(hidden, rest["backbone.layers.1.mixer.fc1_latent_proj.weight"]))
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)
    wrong = adapter.moe_forward(moe, latent_tokens, router_input=hidden @ torch.eye(64).roll(1, 0))
    assert not torch.allclose(block.fc2_latent_proj(wrong) + block.shared_experts(hidden), stock, atol=1e-3)


def test_sweep_captures_the_latent_tokens_and_the_block_input_for_the_router(latent):
    model = load_stock(latent)
    adapter = adapter_for(CheckpointReader(latent).config)
    batches = [{"input_ids": torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(1))}]
    seen = {}
    handles = [
        adapter.decoder_layers(model)[layer]
        .get_submodule(name)
        .register_forward_hook(
            lambda mod, args, out, key=(layer, name): seen.__setitem__(key, args[0].reshape(-1, args[0].shape[-1]))
        )
        for layer in adapter.moe_layers()
        for name in ("mixer", "mixer.experts")
    ]
    with torch.no_grad():
        model(**batches[0])
    for handle in handles:
        handle.remove()
    sweep = CalibrationSweep(latent, batches, torch.zeros(48, dtype=torch.long), ["text"], progress=False)
    layers = []
    for capture in sweep.run():
        layers.append(capture.layer)
        assert capture.moe_input.shape == (48, 32) and capture.router_input.shape == (48, 64)
        torch.testing.assert_close(capture.moe_input, seen[capture.layer, "mixer.experts"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(capture.router_input, seen[capture.layer, "mixer"], rtol=1e-5, atol=1e-5)
        stats = layer_expert_stats(adapter, capture.moe, capture.moe_input, router_input=capture.router_input)
        brute = brute_force_delta_h(adapter, capture.moe, capture.moe_input, router_input=capture.router_input)
        torch.testing.assert_close(stats.delta_h, brute, atol=1e-4, rtol=1e-4)
        assert brute.abs().max() > 0.1
    assert layers == adapter.moe_layers() == [1, 4]


@pytest.mark.parametrize("check", ["inspect", "prune", "mxfp4", "recipe", "streamed"])
def test_latent_config_passes_the_family_sweep_checks(check, latent, tmp_path):
    """The five checks of ``scripts/family_sweep.py --check`` on the latent tiny model: prune --scope layer loads in
    stock transformers with the masked input's logits, mxfp4 loads through the plugin, the default recipe, streamed
    evaluation equal to whole-model evaluation."""
    sweep = _family_sweep()
    if check == "streamed":
        sweep.check_mxfp4(latent, tmp_path / "mxfp4")
    sweep.CHECK_FUNCTIONS[check](latent, tmp_path / check)


def test_latent_gptq_with_lowrank_loads_through_the_plugin_with_the_reported_perplexity(latent, tmp_path):
    out = tmp_path / "gptq"
    options = ["--seq-len", "64", "--eval-tokens", "512", "--calib-tokens", "512"]
    args = ["--scheme", "int4", "--group-size", "32", "--method", "gptq", "--lowrank-budget", "0.5"]
    result = CliRunner().invoke(app, ["quantize", str(latent), "--out", str(out), *options, *args])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "moecompress_report.json").read_text())
    perplexity, model = plain_perplexity(out, 64, 512)
    adapter = adapter_for(json.loads((out / "config.json").read_text()))
    for layer in adapter.moe_layers():
        experts = adapter.experts_of(model, layer)
        assert type(experts).__name__ == "QuantizedExperts" and experts.hidden_size == 32
    assert perplexity == pytest.approx(report["eval"]["perplexity"], rel=1e-4)
    with safe_open(out / "model.safetensors", "pt") as written, safe_open(latent / "model.safetensors", "pt") as read:
        for key in ("backbone.layers.1.mixer.fc1_latent_proj.weight", "backbone.layers.4.mixer.fc2_latent_proj.weight"):
            assert torch.equal(written.get_tensor(key), read.get_tensor(key))


def _family_sweep():
    spec = importlib.util.spec_from_file_location("family_sweep", ROOT / "scripts" / "family_sweep.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["family_sweep"] = module
    spec.loader.exec_module(module)
    return module
