"""Gemma 4: router and experts beside the dense MLP (no MoE block), each with its own input, and a per-expert scale
on the routing weights."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import layer_split, layer_view, load_stock
from safetensors.torch import load_file
from synthetic import TINY_CONFIGS, build_tiny_model, save_tiny_source

from moecompress.cli.main import app
from moecompress.errors import UserInputError
from moecompress.families import adapter_for
from moecompress.passes.expert_scores import brute_force_delta_h, layer_expert_stats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = save_tiny_source("gemma4_text", tmp_path_factory.mktemp("gemma4") / "source")
    return directory


def _stock_site(layer_module, residual):
    """The stock layer's router and experts on ``residual`` ``[T, H]``: the router's projection input, the experts'
    input and their combined output, each as the stock modules compute it."""
    seen = {}
    handles = [
        layer_module.router.proj.register_forward_hook(lambda m, args, out: seen.__setitem__("router", args[0])),
        layer_module.experts.register_forward_hook(lambda m, args, out: seen.update(experts=args[0], output=out)),
    ]
    with torch.no_grad():
        _, weights, ids = layer_module.router(residual)
        layer_module.experts(layer_module.pre_feedforward_layernorm_2(residual), ids, weights)
    for handle in handles:
        handle.remove()
    return seen["router"], seen["experts"], seen["output"]


def test_the_view_routes_on_the_router_input_and_scales_each_chosen_weight(checkpoint):
    adapter, moe, rest, _ = layer_split(checkpoint, 0)
    assert moe.expert_scale.shape == (4,) and "model.layers.0.router.scale" in rest
    layer_module = load_stock(checkpoint).model.layers[0]
    residual = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    router_input, experts_input, stock = _stock_site(layer_module, residual)
    view = adapter.moe_forward(moe, experts_input, router_input=router_input)
    torch.testing.assert_close(view, stock, rtol=1e-5, atol=1e-6)
    unscaled = adapter.moe_forward(replace(moe, expert_scale=None), experts_input, router_input=router_input)
    assert not torch.allclose(unscaled, stock, atol=1e-3)


def test_maep_scores_see_the_scaled_outputs(checkpoint):
    adapter, moe = layer_view(checkpoint, 0)
    layer_module = load_stock(checkpoint).model.layers[0]
    residual = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    router_input, experts_input, _ = _stock_site(layer_module, residual)
    stats = layer_expert_stats(adapter, moe, experts_input, router_input=router_input)
    torch.testing.assert_close(
        stats.delta_h, brute_force_delta_h(adapter, moe, experts_input, router_input=router_input), atol=1e-5, rtol=0
    )
    doubled = replace(moe, expert_scale=moe.expert_scale * torch.tensor([2.0, 1.0, 1.0, 1.0]))
    again = layer_expert_stats(adapter, doubled, experts_input, router_input=router_input)
    assert torch.equal(again.frequency, stats.frequency)
    torch.testing.assert_close(again.reap[0], 2 * stats.reap[0])
    torch.testing.assert_close(again.reap[1:], stats.reap[1:])


def test_pruning_removes_the_scale_with_its_expert_and_quantising_keeps_it(checkpoint, tmp_path):
    sizes = ["--calib-tokens", "256", "--seq-len", "32", "--eval-tokens", "128"]
    pruned, quantized = tmp_path / "pruned", tmp_path / "mxfp4"
    runner = CliRunner()
    result = runner.invoke(
        app, ["prune", str(checkpoint), "--out", str(pruned), "--keep", "2", "--scope", "layer", *sizes]
    )
    assert result.exit_code == 0, result.output
    source = load_file(checkpoint / "model.safetensors")
    written = load_file(pruned / "model.safetensors")
    kept = json.loads((pruned / "config.json").read_text())["moecompress"]["kept_experts"]
    for layer, ids in kept.items():
        prefix = f"model.layers.{layer}.router."
        assert torch.equal(written[prefix + "per_expert_scale"], source[prefix + "per_expert_scale"][ids])
        assert torch.equal(written[prefix + "proj.weight"], source[prefix + "proj.weight"][ids])
        assert torch.equal(written[prefix + "scale"], source[prefix + "scale"])
    result = runner.invoke(app, ["quantize", str(checkpoint), "--out", str(quantized), "--scheme", "mxfp4", *sizes[2:]])
    assert result.exit_code == 0, result.output
    written = load_file(quantized / "model.safetensors")
    modules = json.loads((quantized / "config.json").read_text())["quantization_config"]["modules"]
    assert not [name for name in modules if "router" in name]
    for layer in range(2):
        key = f"model.layers.{layer}.router.per_expert_scale"
        assert written[key].dtype == source[key].dtype and torch.equal(written[key], source[key])


def test_pruned_logits_equal_the_masked_input(checkpoint, tmp_path):
    import family_sweep

    pruned = tmp_path / "pruned"
    sizes = ["--calib-tokens", "256", "--seq-len", "32", "--eval-tokens", "128"]
    result = CliRunner().invoke(
        app, ["prune", str(checkpoint), "--out", str(pruned), "--keep", "2", "--scope", "layer", *sizes]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((pruned / "moecompress_report.json").read_text())
    removed = {int(layer): entry["removed"] for layer, entry in report["layers"].items()}
    adapter = adapter_for(json.loads((checkpoint / "config.json").read_text()))
    reference = load_stock(checkpoint)
    family_sweep._mask_experts(reference, adapter, checkpoint, removed)
    got = family_sweep._logits(load_stock(pruned), adapter, checkpoint)
    difference = got - family_sweep._logits(reference, adapter, checkpoint)
    assert float(difference.abs().max()) <= 1e-5  # float32 rounding of two model copies, as family_sweep's check


def test_kv_sharing_layers_are_refused_in_one_line():
    config = dict(TINY_CONFIGS["gemma4_text"], num_kv_shared_layers=1)
    with pytest.raises(UserInputError, match="num_kv_shared_layers 1"):
        adapter_for(config)


def test_the_default_config_is_dense():
    model = build_tiny_model("gemma4_text")
    config = model.config.to_dict()
    config.update(enable_moe_block=False)
    with pytest.raises(UserInputError, match="no MoE layers"):
        adapter_for(config)
