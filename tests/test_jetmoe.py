"""JetMoE: the MLP experts' grouped router output read and written exactly, the attention's experts (MoA) left as
read by quantisation and pruned to the MLP experts' count by expert pruning, the plugin's experts module in the
block, and the one-line refusal of counts that differ by layer."""

import json

import pytest
import torch
from click.testing import CliRunner
from helpers import load_stock, model_layer_split, run_cli
from safetensors.torch import load_file
from synthetic import build_tiny_model, save_tiny_source

from moecompress.cli.main import app
from moecompress.families import adapter_for
from moecompress.families.jetmoe import JetMoeRoutedBlock

E, H = 8, 64


def _tokens(count=48):
    return torch.randn(1, count, H, generator=torch.Generator().manual_seed(1))


def test_the_mlp_experts_are_the_view_and_the_attention_experts_stay_as_read():
    adapter, moe, rest, layout, tensors = model_layer_split(build_tiny_model("jetmoe"))
    assert torch.equal(moe.gate_up, tensors["model.layers.0.mlp.input_linear.weight"])
    assert torch.equal(moe.down, tensors["model.layers.0.mlp.output_linear.weight"])
    assert {"model.layers.0.mlp.bias", "model.layers.0.self_attention.experts.input_linear.weight"} <= rest.keys()
    joined = adapter.join_layer(0, moe, rest, layout)
    assert joined.keys() == tensors.keys() and all(torch.equal(joined[k], tensors[k]) for k in tensors)
    assert adapter.classify_key("model.layers.0.self_attention.experts.router.layer.weight") == "attention"
    assert adapter.classify_key("model.layers.0.mlp.router.layer.weight") == "router"
    assert adapter.classify_key("model.layers.0.mlp.output_linear.weight") == "experts"
    assert adapter.head_counts() == (4, 2, 16)


def test_the_grouped_route_is_read_and_written_exactly():
    model = build_tiny_model("jetmoe")
    adapter, moe, _, _, _ = model_layer_split(model)
    block = model.model.layers[0].mlp
    hidden = _tokens()[0]
    with torch.no_grad():
        output = block.router(hidden)
        logits, weights, ids = adapter.route_of(output)
        top, want_ids = logits.topk(2, dim=1)
        assert torch.equal(ids, want_ids) and torch.equal(weights, torch.softmax(top, dim=1))
        rewritten = adapter.with_route(output, weights, ids)
        assert [torch.equal(a, b) for a, b in zip(rewritten[1:3], output[1:3], strict=True)] == [True, True]
        assert rewritten[3] == output[3]
        allowed = torch.ones(E, dtype=torch.bool)
        allowed[[0, 5]] = False
        handles = adapter.reroute_hooks(model.model.layers[0], lambda lg: adapter.route(moe, lg, allowed))
        rerouted = block(hidden[None])[0] - block.bias
        for handle in handles:
            handle.remove()
        free = block(hidden[None])[0] - block.bias
        view = adapter.moe_forward(moe, hidden, allowed)
    torch.testing.assert_close(rerouted, view, rtol=0, atol=1e-6)
    assert (rerouted - free).abs().max() > 1e-3


def test_the_plugins_block_computes_what_the_stock_block_does():
    model = build_tiny_model("jetmoe")
    adapter = adapter_for(model.config.to_dict())
    ids = torch.randint(3, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
        adapter.with_experts_module(model)
        assert all(isinstance(layer.mlp, JetMoeRoutedBlock) for layer in model.model.layers)
        routed = model(input_ids=ids).logits
    torch.testing.assert_close(routed, stock, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = save_tiny_source("jetmoe", tmp_path_factory.mktemp("jetmoe") / "source")
    return path


def _prune(source, out, *args):
    options = ["--calib-tokens", "512", "--seq-len", "32", "--no-eval"]
    result = CliRunner().invoke(app, ["prune", str(source), "--out", str(out), "--keep", "4", *options, *args])
    assert result.exit_code == 0, result.output
    return json.loads((out / "moecompress_report.json").read_text())


def _ids():
    return torch.randint(3, 384, (2, 24), generator=torch.Generator().manual_seed(0))


def _masked_logits(source, report, attention=True):
    """The input's logits with the removed MLP experts (and, with ``attention``, the removed MoA experts) routed
    around, as the family's rule routes a block without them."""
    model = load_stock(source)
    adapter = adapter_for(json.loads((source / "config.json").read_text()))
    rule = adapter.routing_rule()
    for layer, entry in report["layers"].items():
        decoder_layer = adapter.decoder_layers(model)[int(layer)]
        allowed = torch.ones(E, dtype=torch.bool)
        allowed[entry["removed"]] = False
        adapter.reroute_hooks(decoder_layer, lambda logits, allowed=allowed: rule.route(logits, None, allowed))
        if attention:
            allowed = torch.ones(E, dtype=torch.bool)
            allowed[entry["attention_removed"]] = False
            adapter.attention_reroute_hooks(decoder_layer, allowed)
    with torch.no_grad():
        return model(input_ids=_ids()).logits


@pytest.mark.parametrize("method", ["maep", "frequency"])
def test_layer_scope_prune_removes_as_many_moa_experts_and_loads_in_stock_transformers(source, tmp_path, method):
    out = tmp_path / "pruned"
    report = _prune(source, out, "--scope", "layer", "--method", method)
    config = json.loads((out / "config.json").read_text())
    assert config["num_local_experts"] == 4
    model, loading = load_stock(out), None
    _, loading = type(model).from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    before, after = load_file(source / "model.safetensors"), load_file(out / "model.safetensors")
    for layer, entry in report["layers"].items():
        load = entry["attention_load"]
        kept = sorted(sorted(range(E), key=lambda e: (-load[e], e))[:4])
        assert entry["attention_kept"] == kept == config["moecompress"]["kept_attention_experts"][layer]
        assert sum(load) == pytest.approx(1.0)
        for name in ("input_linear.weight", "output_linear.weight", "router.layer.weight"):
            key = f"model.layers.{layer}.self_attention.experts.{name}"
            assert torch.equal(after[key], before[key][kept])
        bias = f"model.layers.{layer}.self_attention.experts.bias"
        assert torch.equal(after[bias], before[bias])
    with torch.no_grad():
        pruned = model(input_ids=_ids()).logits
    torch.testing.assert_close(pruned, _masked_logits(source, report), rtol=0, atol=0)
    assert (pruned - _masked_logits(source, report, attention=False)).abs().max() > 1e-4


def test_pruning_a_pruned_checkpoint_names_the_original_moa_experts(source, tmp_path):
    first = _prune(source, tmp_path / "first", "--scope", "layer")
    out = tmp_path / "second"
    options = ["--calib-tokens", "512", "--seq-len", "32", "--no-eval", "--scope", "layer"]
    result = CliRunner().invoke(app, ["prune", str(tmp_path / "first"), "--out", str(out), "--keep", "2", *options])
    assert result.exit_code == 0, result.output
    second = json.loads((out / "moecompress_report.json").read_text())
    for layer, entry in second["layers"].items():
        assert entry["attention_expert_ids"] == first["layers"][layer]["attention_kept"]
        assert set(entry["attention_kept"]) < set(entry["attention_expert_ids"]) and len(entry["attention_kept"]) == 2
    config = json.loads((out / "config.json").read_text())
    assert config["num_local_experts"] == 2
    load_stock(out)


def test_merging_cuts_the_moa_to_the_merged_count(source, tmp_path):
    out = tmp_path / "merged"
    report = _prune(source, out, "--scope", "layer", "--method", "merge")
    _, loading = type(load_stock(out)).from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    assert all(len(entry["attention_kept"]) == 4 for entry in report["layers"].values())


def test_global_scope_is_one_line_exit_2_before_work(source, tmp_path):
    out = tmp_path / "global"
    result = run_cli("prune", str(source), "--out", str(out), "--keep", "4", "--scope", "global")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    expected = "so every layer must keep as many experts: --scope global cannot be written (use --scope layer)"
    assert expected in result.stderr
    assert not out.exists()
    assert adapter_for(json.loads((source / "config.json").read_text())).num_experts == E


def _swept_last_hidden(source, report, attention: bool) -> list[torch.Tensor]:
    """The calibration sweep's last hidden states when each layer is recomputed as the rewriting sweep recomputes a
    pruned layer: the kept MLP experts placed at their indices, the removed ones (and, with ``attention``, the
    removed MoA experts) routed around."""
    from moecompress.runner.pipeline import _replacement
    from moecompress.sweep.engine import CalibrationSweep

    batches = [{"input_ids": _ids()}]
    sweep = CalibrationSweep(source, batches, torch.zeros(48, dtype=torch.long), ["text"], progress=False)
    for capture in sweep.run(None):
        entry = report["layers"][str(capture.layer)]
        capture.replacement, capture.allowed = _replacement(capture.moe, capture.moe.select(entry["kept"]))
        if attention:
            allowed = torch.zeros(E, dtype=torch.bool)
            allowed[entry["attention_kept"]] = True
            capture.extra["attention_allowed"] = allowed
    return sweep.last_hidden


def test_the_sweep_recomputes_a_pruned_layer_as_the_pruned_model_computes_it(source, tmp_path):
    out = tmp_path / "pruned"
    report = _prune(source, out, "--scope", "layer")
    model, stock = load_stock(out), []
    handle = model.model.layers[-1].register_forward_hook(lambda module, args, output: stock.append(output))
    with torch.no_grad():
        model(input_ids=_ids())
    handle.remove()
    stock = [state[0] if isinstance(state, tuple) else state for state in stock]
    torch.testing.assert_close(_swept_last_hidden(source, report, attention=True)[0], stock[0], rtol=0, atol=1e-6)
    assert (_swept_last_hidden(source, report, attention=False)[0] - stock[0]).abs().max() > 1e-4
