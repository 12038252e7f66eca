"""Muse Spark: experts in a latent space with a norm shared by every expert on each expert's output, a scaled sigmoid
router, and the vision and audio towers passed through."""

import json
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner
from helpers import layer_split, load_stock
from safetensors import safe_open
from synthetic import save_tiny_source

from moecompress.checkpoint import CheckpointReader
from moecompress.cli.main import app
from moecompress.families import adapter_for
from moecompress.passes.expert_scores import brute_force_delta_h, layer_expert_stats
from moecompress.sweep.engine import CalibrationSweep

NORM = "model.language_model.layers.{}.mlp.experts.post_expert_norm.weight"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = save_tiny_source("muse_spark", tmp_path_factory.mktemp("muse_spark") / "source")
    return directory


def _tensor(directory, key):
    with safe_open(directory / "model.safetensors", "pt") as handle:
        return handle.get_tensor(key)


def test_release_layout_latent_view_and_towers(checkpoint):
    adapter, moe, rest, layout = layer_split(checkpoint, 1)
    assert adapter.moe_layers() == [1, 2] and adapter.latent_experts and adapter.experts_width == 32
    assert layout == "fused" and tuple(moe.gate_up.shape) == (8, 128, 32) and tuple(moe.down.shape) == (8, 32, 64)
    assert tuple(moe.router_weight.shape) == (8, 64) and moe.correction_bias.shape == (8,)
    assert torch.equal(moe.output_norm, rest[NORM.format(1)]) and adapter.classify_key(NORM.format(1)) == "norms"
    assert {adapter.classify_key(key) for key in rest if "_expert_proj" in key} == {"other"}
    with CheckpointReader(checkpoint) as reader:
        towers = {adapter.classify_key(key) for key in reader.keys() if key.startswith(adapter._VISION_PREFIXES)}
    assert towers == {"vision"}


def test_the_shared_output_norm_and_the_logit_multiplier_are_the_stock_modules(checkpoint):
    adapter, moe, _, _ = layer_split(checkpoint, 1)
    block = load_stock(checkpoint).model.language_model.layers[1].mlp
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, weights, ids = block.gate(hidden)
        latent = block.pre_expert_norm(block.pre_expert_proj(hidden))
        stock = block.experts(latent, ids, weights)
        ours = adapter.moe_forward(moe, latent, router_input=hidden)
        stock_block = block(hidden.unsqueeze(0))[0]
    torch.testing.assert_close(adapter.router_logits(moe, hidden), logits)
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block.post_expert_proj(ours), stock_block, rtol=1e-5, atol=1e-5)
    without = adapter.moe_forward(
        replace(moe, output_norm=torch.zeros_like(moe.output_norm)), latent, router_input=hidden
    )
    assert not torch.allclose(without, stock, atol=1e-2)


def test_sweep_routes_on_the_block_input_and_measures_the_normalised_experts(checkpoint):
    batches = [{"input_ids": torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(1))}]
    sweep = CalibrationSweep(checkpoint, batches, torch.zeros(48, dtype=torch.long), ["text"], progress=False)
    adapter = adapter_for(CheckpointReader(checkpoint).config)
    for capture in sweep.run():
        assert capture.moe_input.shape == (48, 32) and capture.router_input.shape == (48, 64)
        assert torch.equal(capture.moe.output_norm, _tensor(checkpoint, NORM.format(capture.layer)))
        stats = layer_expert_stats(adapter, capture.moe, capture.moe_input, router_input=capture.router_input)
        brute = brute_force_delta_h(adapter, capture.moe, capture.moe_input, router_input=capture.router_input)
        torch.testing.assert_close(stats.delta_h, brute, atol=1e-4, rtol=1e-4)
        assert brute.abs().max() > 0.1


def test_prune_keeps_the_norm_and_towers_and_quantised_experts_apply_the_norm(checkpoint, tmp_path):
    import moecompress  # noqa: F401 - the plugin

    options = ["--seq-len", "64", "--eval-tokens", "512"]
    pruned = tmp_path / "pruned"
    result = CliRunner().invoke(
        app, ["prune", str(checkpoint), "--out", str(pruned), "--keep", "4", "--calib-tokens", "512", *options]
    )
    assert result.exit_code == 0, result.output
    with (
        safe_open(pruned / "model.safetensors", "pt") as written,
        safe_open(checkpoint / "model.safetensors", "pt") as read,
    ):
        unchanged = [key for key in read.keys() if "post_expert_norm" in key or key.startswith("model.audio_tower.")]
        assert len(unchanged) > 2
        assert all(torch.equal(written.get_tensor(key), read.get_tensor(key)) for key in unchanged)
        assert written.get_tensor("model.language_model.layers.1.mlp.experts.gate_up_proj").shape[0] == 4

    quantized = tmp_path / "quantized"
    result = CliRunner().invoke(
        app, ["quantize", str(checkpoint), "--out", str(quantized), "--scheme", "mxfp4", *options]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((quantized / "config.json").read_text())["quantization_config"]
    model, stock = load_stock(quantized), load_stock(checkpoint)
    generator = torch.Generator().manual_seed(2)
    for layer in (1, 2):
        experts = model.model.language_model.layers[layer].mlp.experts
        reference = stock.model.language_model.layers[layer].mlp.experts
        assert type(experts).__name__ == "QuantizedExperts"
        assert torch.equal(experts.post_expert_norm.weight, _tensor(checkpoint, NORM.format(layer)))
        with torch.no_grad():
            for expert in range(8):
                gate_up, down = experts.expert_weights(expert, torch.float32)
                reference.gate_up_proj[expert] = gate_up
                reference.down_proj[expert] = down
            latent = torch.randn(30, 32, generator=generator)
            ids = torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(30)])
            weights = torch.rand(30, 2, generator=generator)
            torch.testing.assert_close(experts(latent, ids, weights), reference(latent, ids, weights))
            experts.post_expert_norm.weight.zero_()
            assert not torch.allclose(experts(latent, ids, weights), reference(latent, ids, weights), atol=1e-2)
