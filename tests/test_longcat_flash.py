"""LongCat-Flash's identity (zero-computation) experts: routed, measured and kept, never pruned or quantised."""

import json

import pytest
import torch
from click.testing import CliRunner
from helpers import assert_delta_h_with_removed_experts, copy_with_tokenizer, layer_view, load_stock
from safetensors.torch import load_file

from moecompress.cli.main import app
from moecompress.families import adapter_for
from moecompress.passes.expert_scores import brute_force_delta_h, layer_expert_stats

FFN, IDENTITY = 8, 4


def _hidden(tokens, seed=0):
    return torch.randn(tokens, 64, generator=torch.Generator().manual_seed(seed))


def test_view_holds_the_identity_router_rows(tiny_checkpoints):
    adapter, moe = layer_view(tiny_checkpoints["longcat_flash"], 0)
    assert (moe.num_experts, moe.identity_experts, moe.router_columns) == (FFN, IDENTITY, FFN + IDENTITY)
    assert moe.router_weight.shape[0] == moe.correction_bias.shape[0] == FFN + IDENTITY
    assert adapter.route_ids(0) == [*range(FFN), -1, -2, -3, -4]
    kept = moe.select([6, 1, 3])
    assert kept.expert_ids == [6, 1, 3] and kept.identity_experts == IDENTITY
    rows = [6, 1, 3, *range(FFN, FFN + IDENTITY)]
    assert torch.equal(kept.router_weight, moe.router_weight[rows])
    assert torch.equal(kept.correction_bias, moe.correction_bias[rows])


def test_identity_experts_are_measured_and_never_scored(tiny_checkpoints):
    adapter, moe = layer_view(tiny_checkpoints["longcat_flash"], 0)
    hidden = _hidden(300)
    ids, _ = adapter.routing_rule().route(adapter.router_logits(moe, hidden), moe.correction_bias)
    identity_slots = int((ids >= FFN).sum())
    assert identity_slots > 0, "the tiny model must route some tokens to identity experts"

    stats = layer_expert_stats(adapter, moe, hidden, chunk_tokens=128)
    assert stats.delta_h.shape == (300, FFN) and stats.frequency.shape == (FFN,)
    assert stats.identity_counts.shape == (IDENTITY,)
    assert int(stats.identity_counts.sum()) == identity_slots
    assert int(stats.routed_counts.sum()) + identity_slots == ids.numel()
    torch.testing.assert_close(stats.delta_h, brute_force_delta_h(adapter, moe, hidden), rtol=1e-5, atol=1e-5)
    assert stats.delta_h.max() > 0.1


def test_delta_h_with_experts_already_removed_keeps_identity_experts_routable(tiny_checkpoints):
    adapter, moe = layer_view(tiny_checkpoints["longcat_flash"], 0)
    hidden = _hidden(200, seed=2)
    removed = torch.zeros(FFN, dtype=torch.bool)
    removed[[1, 6]] = True
    present = torch.cat([~removed, torch.ones(IDENTITY, dtype=torch.bool)])
    assert_delta_h_with_removed_experts(adapter, moe, hidden, removed, present)


def test_masked_route_equals_route_of_the_pruned_router(tiny_checkpoints):
    adapter, moe = layer_view(tiny_checkpoints["longcat_flash"], 0)
    hidden = _hidden(200, seed=1)
    rule = adapter.routing_rule()
    keep = [0, 2, 3, 7]
    allowed = torch.zeros(FFN + IDENTITY, dtype=torch.bool)
    allowed[keep + list(range(FFN, FFN + IDENTITY))] = True
    ids, weights = rule.route(adapter.router_logits(moe, hidden), moe.correction_bias, allowed)
    pruned = moe.select(keep)
    pruned_ids, pruned_weights = rule.route(adapter.router_logits(pruned, hidden), pruned.correction_bias)
    mapped = torch.tensor(keep + list(range(FFN, FFN + IDENTITY)))[pruned_ids]
    assert torch.equal(ids.sort(-1).values, mapped.sort(-1).values)
    torch.testing.assert_close(weights.gather(1, ids.argsort(-1)), pruned_weights.gather(1, mapped.argsort(-1)))


@pytest.fixture(scope="module")
def source(tiny_checkpoints, tmp_path_factory):
    return copy_with_tokenizer(tiny_checkpoints["longcat_flash"], tmp_path_factory.mktemp("longcat") / "source")


def _run(*args):
    result = CliRunner().invoke(app, [str(arg) for arg in args])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_prune_removes_ffn_experts_only(source, tmp_path, scope):
    out = tmp_path / "pruned"
    options = ["--ratio", "0.4"] if scope == "global" else ["--keep", "4"]
    _run("prune", source, "--out", out, *options, "--scope", scope, "--calib-tokens", 512, "--seq-len", 64,
         "--eval-tokens", 128)  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    report = json.loads((out / "moecompress_report.json").read_text())
    assert config["zero_expert_num"] == IDENTITY
    before = load_file(str(source / "model.safetensors"))
    after = {}
    for shard in out.glob("*.safetensors"):
        after.update(load_file(str(shard)))
    for layer, entry in report["layers"].items():
        kept = entry["kept"]
        assert len(kept) + len(entry["removed"]) == FFN and max(kept) < FFN
        assert len(entry["identity_frequency"]) == IDENTITY and sum(entry["identity_frequency"]) > 0
        prefix = f"model.layers.{layer}.mlp.router."
        rows = kept + list(range(FFN, FFN + IDENTITY))
        assert torch.equal(after[prefix + "classifier.weight"], before[prefix + "classifier.weight"][rows])
        assert torch.equal(after[prefix + "e_score_correction_bias"], before[prefix + "e_score_correction_bias"][rows])
    if scope == "layer":
        assert config["n_routed_experts"] == 4
    import moecompress  # noqa: F401 - the plugin builds each layer's count

    model = load_stock(out)
    adapter = adapter_for(config)
    for layer in adapter.moe_layers():
        assert adapter.moe_block_of(model, layer).router.classifier.weight.shape[0] == (
            adapter.experts_in_layer(layer) + IDENTITY
        )
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.arange(3, 40)[None]).logits).all()


def test_mxfp4_leaves_the_router_and_its_identity_rows_alone(source, tmp_path):
    out = tmp_path / "mxfp4"
    _run("quantize", source, "--out", out, "--scheme", "mxfp4", "--seq-len", 64, "--eval-tokens", 128)
    before = load_file(str(source / "model.safetensors"))
    after = {}
    for shard in out.glob("*.safetensors"):
        after.update(load_file(str(shard)))
    for layer in (0, 1):
        for name in ("classifier.weight", "e_score_correction_bias"):
            key = f"model.layers.{layer}.mlp.router.{name}"
            assert torch.equal(after[key], before[key]), key
