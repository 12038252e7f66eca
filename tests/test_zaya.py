"""ZAYA1: the router state carried from layer to layer by the layer sweep, and the skip expert (a router column past
the experts with no output, never pruned)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import copy_with_tokenizer, layer_view, load_stock, token_batches
from safetensors.torch import load_file, save_file

from moecompress.families import adapter_for
from moecompress.passes.expert_scores import brute_force_delta_h, layer_expert_stats
from moecompress.sweep.engine import CalibrationSweep
from moecompress.sweep.layer_carry import LayerCarry

EXPERTS = 8
SKIP_SCALE, EXPERT_BIAS = 8.0, -0.5
"""The skip expert's router row scaled and the experts' balancing biases lowered, so that the tiny model sends some
tokens to the skip expert (its random one never does: the skip expert's bias is -1)."""


@pytest.fixture(scope="module")
def skipping(tiny_checkpoints, tmp_path_factory):
    path = copy_with_tokenizer(tiny_checkpoints["zaya"], tmp_path_factory.mktemp("zaya") / "source")
    tensors = load_file(str(path / "model.safetensors"))
    for key in list(tensors):
        if key.endswith("router_mlp.out_proj.weight"):
            tensors[key][EXPERTS] *= SKIP_SCALE
        elif key.endswith("balancing_biases"):
            tensors[key][:EXPERTS] = EXPERT_BIAS
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _swept(checkpoint, batches):
    tokens = sum(batch["input_ids"].numel() for batch in batches)
    sweep = CalibrationSweep(checkpoint, batches, torch.zeros(tokens, dtype=torch.long), ["text"], progress=False)
    for _ in sweep.run(None):
        pass
    return sweep.last_hidden


def _stock(checkpoint, batches):
    model = load_stock(checkpoint)
    adapter = adapter_for(json.loads((checkpoint / "config.json").read_text()))
    outputs = []
    handle = adapter.decoder_layers(model)[-1].register_forward_hook(lambda m, a, out: outputs.append(out[0]))
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    handle.remove()
    return outputs


def test_sweep_carries_the_router_state(skipping, monkeypatch):
    batches = token_batches()
    stock = _stock(skipping, batches)
    for swept, expected in zip(_swept(skipping, batches), stock, strict=True):
        torch.testing.assert_close(swept, expected, rtol=0, atol=1e-6)
    monkeypatch.setattr(LayerCarry, "with_outputs", lambda self, layer, batch, args: args)
    uncarried = _swept(skipping, batches)
    assert max((a - b).abs().max().item() for a, b in zip(uncarried, stock, strict=True)) > 1e-2


def test_view_routes_to_the_skip_expert_as_the_stock_router(skipping):
    model = load_stock(skipping)
    hidden = torch.randn(200, 64, generator=torch.Generator().manual_seed(1))
    skipped = 0
    for layer in (0, 1, 2):
        adapter, moe = layer_view(skipping, layer)
        assert (moe.num_experts, moe.router_columns) == (EXPERTS, EXPERTS + 1)
        captured = []
        out_proj = adapter.decoder_layers(model)[layer].get_submodule(adapter.router_input_module)
        handle = out_proj.register_forward_hook(lambda m, args, out, into=captured: into.append(args[0]))
        with torch.no_grad():
            _, stock_weights, stock_ids = adapter.stock_route(model, layer, hidden)
            stock_out = adapter.stock_experts(model, layer, hidden, stock_ids, stock_weights)
            ids, weights = adapter.route(moe, adapter.router_logits(moe, captured[0]))
            ours = adapter.moe_forward(moe, hidden, router_input=captured[0])
        handle.remove()
        assert torch.equal(ids, stock_ids) and torch.equal(weights, stock_weights.float())
        torch.testing.assert_close(ours, stock_out, rtol=1e-4, atol=1e-5)
        skip = (ids == EXPERTS).squeeze(1)
        assert torch.all(weights[skip] == 0) and torch.all(ours[skip] == 0)
        skipped += int(skip.sum())
        router_input = captured[0].reshape(-1, captured[0].shape[-1])
        delta_h = layer_expert_stats(adapter, moe, hidden, router_input=router_input).delta_h
        expected = brute_force_delta_h(adapter, moe, hidden, router_input=router_input)
        torch.testing.assert_close(delta_h, expected, rtol=1e-5, atol=1e-5)
    assert 0.05 < skipped / 600 < 0.95, skipped


def test_prune_keeps_the_skip_row_and_matches_the_masked_input(skipping, tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    import family_sweep

    family_sweep.check_prune(skipping, tmp_path / "pruned")
    before = load_file(str(skipping / "model.safetensors"))
    after = {}
    for shard in (tmp_path / "pruned").glob("*.safetensors"):
        after.update(load_file(str(shard)))
    report = json.loads((tmp_path / "pruned" / "moecompress_report.json").read_text())
    for layer, entry in report["layers"].items():
        rows = [*entry["kept"], EXPERTS]
        for name in ("router_mlp.out_proj.weight", "balancing_biases"):
            key = f"model.layers.{layer}.mlp.gate.{name}"
            assert torch.equal(after[key], before[key][rows]), key
