"""Inkling's shared experts, routed together with the routed ones: held as router columns, weighted with them, never
pruned or quantised."""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from helpers import layer_split, load_stock
from safetensors.torch import load_file
from synthetic import tiny_tokenizer

from moecompress.cli.main import app
from moecompress.families import adapter_for
from moecompress.passes.expert_scores import brute_force_delta_h, layer_expert_stats

ROUTED, SHARED, TOP_K = 8, 2, 2
INKLING = ("inkling_text", "inkling_mm_model")


def _hidden(tokens, seed=0):
    return torch.randn(tokens, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", INKLING)
def test_view_holds_the_shared_router_rows(family, tiny_checkpoints):
    adapter, moe, rest, layout = layer_split(tiny_checkpoints[family], 1)
    assert adapter.moe_layers() == [1, 2]
    assert (moe.num_experts, moe.identity_experts, moe.router_columns) == (ROUTED, SHARED, ROUTED + SHARED)
    assert moe.router_weight.shape[0] == moe.correction_bias.shape[0] == ROUTED + SHARED
    kept = moe.select([6, 1, 3])
    rows = [6, 1, 3, ROUTED, ROUTED + 1]
    assert torch.equal(kept.router_weight, moe.router_weight[rows])
    assert torch.equal(kept.shared_gate, moe.shared_gate) and torch.equal(kept.global_scale, moe.global_scale)
    written = adapter.join_layer(1, kept, rest, layout)
    bias = next(value for key, value in written.items() if key.endswith(("e_score_correction_bias", "gate.bias")))
    assert torch.equal(bias, moe.correction_bias[[6, 1, 3]])


@pytest.mark.parametrize("family", INKLING)
def test_removing_a_routed_expert_reweighs_the_shared_experts(family, tiny_checkpoints):
    adapter, moe, _, _ = layer_split(tiny_checkpoints[family], 1)
    hidden = _hidden(200)
    logits = adapter.router_logits(moe, hidden)
    ids, weights = adapter.route(moe, logits)
    assert ids.shape == (200, TOP_K + SHARED) and torch.equal(ids[:, TOP_K:], torch.tensor([[8, 9]]).expand(200, -1))
    allowed = torch.ones(ROUTED + SHARED, dtype=torch.bool)
    allowed[ids[0, 0]] = False
    masked_ids, masked_weights = adapter.route(moe, logits, allowed)
    assert not torch.equal(masked_weights[0, TOP_K:], weights[0, TOP_K:])
    # the weights' normalisation spans the routed and shared experts: sigmoid over their sum, times the scales
    scores = logits.gather(1, masked_ids).sigmoid()
    expected = scores / scores.sum(-1, keepdim=True) * adapter.routing_rule().scaling * moe.global_scale
    torch.testing.assert_close(masked_weights, expected)


@pytest.mark.parametrize("family", INKLING)
def test_delta_h_counts_the_shared_experts_change(family, tiny_checkpoints):
    adapter, moe, _, _ = layer_split(tiny_checkpoints[family], 1)
    hidden = _hidden(150, seed=1)
    stats = layer_expert_stats(adapter, moe, hidden, chunk_tokens=64)
    assert stats.delta_h.shape == (150, ROUTED) and stats.identity_counts.tolist() == [150.0, 150.0]
    torch.testing.assert_close(stats.delta_h, brute_force_delta_h(adapter, moe, hidden), rtol=1e-5, atol=1e-5)
    # without the shared experts' reweighting (their outputs left out) ΔH would be another number
    logits = adapter.router_logits(moe, hidden)

    def routed_only(allowed=None):
        ids, weights = adapter.route(moe, logits, allowed)
        return adapter.combine_experts(
            hidden, ids, weights, lambda e, x: None if e >= ROUTED else adapter.expert_output(moe, e, x)
        )

    eye = torch.eye(ROUTED + SHARED, dtype=torch.bool)
    without_shared = torch.stack([(routed_only() - routed_only(~eye[e])).norm(dim=-1) for e in range(ROUTED)], 1)
    assert (stats.delta_h - without_shared).abs().max() > 1e-2


@pytest.fixture(scope="module", params=INKLING)
def source(request, tiny_checkpoints, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "source"
    shutil.copytree(tiny_checkpoints[request.param], path)
    tiny_tokenizer().save_pretrained(path)
    return path


def _run(*args):
    result = CliRunner().invoke(app, [str(arg) for arg in args])
    assert result.exit_code == 0, result.output


def _tensors(directory):
    out = {}
    for shard in directory.glob("*.safetensors"):
        out.update(load_file(str(shard)))
    return out


def test_prune_keeps_the_shared_experts_and_their_router_rows(source, tmp_path):
    out = tmp_path / "pruned"
    _run("prune", source, "--out", out, "--keep", 4, "--scope", "layer", "--calib-tokens", 512, "--seq-len", 64,
         "--eval-tokens", 128)  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    adapter = adapter_for(config)
    report = json.loads((out / "moecompress_report.json").read_text())
    before, after = _tensors(source), _tensors(out)
    for layer, entry in report["layers"].items():
        kept = entry["kept"]
        assert len(kept) == 4 and max(kept) < ROUTED and entry["identity_frequency"] == [1.0, 1.0]
        router = adapter._router_key(int(layer), "weight")
        assert torch.equal(after[router], before[router][[*kept, ROUTED, ROUTED + 1]])
        shared = [key for key in before if key.startswith(adapter.layer_prefix(int(layer))) and "shared" in key]
        assert shared and all(torch.equal(after[key], before[key]) for key in shared)
    assert adapter.text_config["n_routed_experts"] == 4
    model = load_stock(out)
    assert adapter.router_of(model, 1).weight.shape[0] == 4 + SHARED


def test_mxfp4_quantises_the_routed_experts_only(source, tmp_path):
    import moecompress  # noqa: F401 - the plugin

    out = tmp_path / "mxfp4"
    _run("quantize", source, "--out", out, "--scheme", "mxfp4", "--seq-len", 64, "--eval-tokens", 128)
    adapter = adapter_for(json.loads((out / "config.json").read_text()))
    original, model = load_stock(source), load_stock(out)
    for layer in adapter.moe_layers():
        for part in ("gate", "shared_experts"):
            before = adapter.moe_block_of(original, layer).get_submodule(part).state_dict()
            after = adapter.moe_block_of(model, layer).get_submodule(part).state_dict()
            assert before.keys() == after.keys() and len(before) >= 3
            assert all(torch.equal(after[name], before[name]) for name in before), (layer, part)
    assert {type(adapter.experts_of(model, layer)).__name__ for layer in adapter.moe_layers()} == {"QuantizedExperts"}
