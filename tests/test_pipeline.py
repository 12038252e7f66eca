"""The layer pipeline: a recipe's layer passes share their sweeps and write the output once; sequential calibration
through a pruned block computes what the pruned model computes; ``run --dry-run`` prints the plan."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import run_cli
from safetensors.torch import load_file

from moecompress.passes.prune_experts import PruneExpertsConfig
from moecompress.passes.quantize import QuantizeConfig, _components_for_budget
from moecompress.runner.pipeline import _replacement, plan_stages, run_layer_passes
from moecompress.runner.recipes import Calibration, parse_recipe, run_recipe

DEFAULT = Path(__file__).parent.parent / "recipes" / "default.yaml"
CALIBRATION = {"source": "builtin:prose", "tokens": 512, "seq_len": 64, "seed": 2}


def _tensors_equal(first: Path, second: Path) -> list[str]:
    """Names of the tensors that differ between two single-shard checkpoints (both must hold the same names)."""
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys()
    return [key for key in a if not torch.equal(a[key], b[key])]


def test_dry_run_prints_the_plan_and_does_no_work(tmp_path):
    result = run_cli("run", str(DEFAULT), "--dry-run", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    plan = result.stdout.split("plan:\n", 1)[1].splitlines()
    assert plan[0].strip() == "stage 1: one layer pipeline of prune_experts, quantize, on the input"
    assert "sensitivity sweep (fisher-token)" in plan[1]
    assert "measuring sweep" in plan[2] and "maep expert scores" in plan[2] and "error spectra" in plan[2]
    assert "rewriting sweep (calibrated, sequential)" in plan[3] and "writes the output once" in plan[3]
    assert plan[-1].strip() == "checkpoint reads before the evaluation: 4"
    assert not (tmp_path / "out").exists()


def test_whole_model_passes_are_stages_of_their_own():
    recipe = parse_recipe(
        {
            "passes": [
                {"prune_heads": {}},
                {"prune_experts": {"ratio": 0.25}},
                {"quantize": {"scheme": "mxfp4"}},
            ]
        }
    )
    stages = plan_stages(recipe.passes)
    assert [(stage.kind, stage.names) for stage in stages] == [
        ("model", ["prune_heads"]),
        ("layer", ["prune_experts", "quantize"]),
    ]
    assert [stage.names for stage in plan_stages(recipe.passes, chained=True)] == [
        ["prune_heads"],
        ["prune_experts"],
        ["quantize"],
    ]


def test_prune_and_gptq_in_one_pipeline_equal_the_passes_chained(tiny_with_tokenizer, tmp_path):
    """GPTQ in the chained run calibrates on the pruned checkpoint with each quantised layer's outputs feeding the
    next; the pipeline gets the same inputs from the pruned block recomputed at its original size with the pruned
    experts routed around, so the two write the same tensors."""
    source = tiny_with_tokenizer["qwen3_moe"]
    recipe = parse_recipe(
        {
            "calibration": CALIBRATION,
            "passes": [{"prune_experts": {"ratio": 0.25}}, {"quantize": {"scheme": "int4", "method": "gptq"}}],
        }
    )
    report = run_recipe(recipe, source, tmp_path / "pipeline", progress=False)
    run_recipe(recipe, source, tmp_path / "chained", progress=False, chained=True)
    assert _tensors_equal(tmp_path / "pipeline", tmp_path / "chained") == []
    assert (tmp_path / "pipeline" / "config.json").read_bytes() == (tmp_path / "chained" / "config.json").read_bytes()
    assert report["pass"] == "quantize" and [p["pass"] for p in report["previous_passes"]] == ["prune_experts"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chained", "pipeline"]


def test_the_rank_budget_after_pruning_counts_the_kept_experts_only(tiny_with_tokenizer, tmp_path):
    source = tiny_with_tokenizer["qwen3_moe"]
    passes = [
        ("prune_experts", PruneExpertsConfig(ratio=0.25, seed=2)),
        ("quantize", QuantizeConfig(scheme="int2", lowrank_budget=0.5, sensitivity="none", seed=2)),
    ]
    out = tmp_path / "out"
    report = run_layer_passes(source, out, passes, Calibration(**CALIBRATION), progress=False)
    config = json.loads((out / "config.json").read_text())
    kept = {int(layer): len(entry["kept"]) for layer, entry in report["previous_passes"][0]["layers"].items()}
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    prune = report["previous_passes"][0]
    assert sum(kept.values()) == prune["experts_after"] < prune["experts_before"]
    assert report["lowrank"]["components"] == _components_for_budget(0.5, [(n, hidden, inter) for n in kept.values()])
    assert report["lowrank"]["components_used"] <= report["lowrank"]["components"]
    for layer, stats in report["layers"].items():
        assert all(len(ranks) == kept[int(layer)] for ranks in stats["lowrank_ranks"].values())


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_the_measuring_sweep_measures_spectra_only_for_the_experts_a_layer_scope_pruning_keeps(
    tiny_with_tokenizer, tmp_path, monkeypatch, scope
):
    import moecompress.passes.quantize as quantize
    from moecompress.passes.prune_experts_layer import PruneExpertsPass

    source = tiny_with_tokenizer["qwen3_moe"]
    passes = [
        ("prune_experts", PruneExpertsConfig(ratio=0.25, scope=scope, seed=2)),
        ("quantize", QuantizeConfig(scheme="int2", lowrank_budget=0.5, sensitivity="none", seed=2)),
    ]
    measured, unwrapped = {}, quantize.layer_errors

    def recording(adapter, moe, *args, measure=False, experts=None, **kwargs):
        if not measure:
            measured[moe.layer] = experts
        return unwrapped(adapter, moe, *args, measure=measure, experts=experts, **kwargs)

    monkeypatch.setattr(quantize, "layer_errors", recording)
    report = run_layer_passes(source, tmp_path / "out", passes, Calibration(**CALIBRATION), progress=False)
    layers = report["previous_passes"][0]["layers"]
    kept = {int(n): [entry["expert_ids"].index(e) for e in entry["kept"]] for n, entry in layers.items()}
    assert measured == (kept if scope == "layer" else dict.fromkeys(kept))
    monkeypatch.setattr(PruneExpertsPass, "keeps", lambda self, layer: None)
    run_layer_passes(source, tmp_path / "all", passes, Calibration(**CALIBRATION), progress=False)
    assert _tensors_equal(tmp_path / "out", tmp_path / "all") == []


def test_a_pruned_replacement_keeps_the_block_size_and_allows_only_the_kept_experts():
    from moecompress.families import MoEWeights

    generator = torch.Generator().manual_seed(0)
    block = MoEWeights(
        router_weight=torch.randn(6, 4, generator=generator),
        gate_up=torch.randn(6, 10, 4, generator=generator),
        down=torch.randn(6, 4, 5, generator=generator),
        expert_ids=[0, 1, 2, 3, 4, 5],
    )
    pruned = block.select([1, 4])
    source, allowed = _replacement(block, pruned)
    assert allowed.tolist() == [False, True, False, False, True, False]
    assert source.num_experts == 6 and source.expert(0) is None
    assert torch.equal(source.expert(4).gate_up[0], block.gate_up[4])
    full = source.padded(block)
    assert full.gate_up.shape == block.gate_up.shape and torch.equal(full.gate_up[4], block.gate_up[4])
    assert not full.gate_up[0].any() and torch.equal(full.router_weight, block.router_weight)
    same, none = _replacement(block, block.select(list(range(6))))
    assert none is None and same.num_experts == 6


def test_view_experts_compute_what_the_block_computes():
    """The sweeps' experts module (one expert at a time from the view, a quantised block dequantised expert by
    expert) gives the block's routed output as the adapter computes it."""
    from moecompress.checkpoint import resolve_model
    from moecompress.loading import load_adapter
    from moecompress.quantization.experts import quantize_experts_rtn
    from moecompress.quantization.scheme import QuantScheme
    from moecompress.sweep.engine import CalibrationSweep
    from moecompress.sweep.view_experts import ExpertSource, ViewExperts

    model = resolve_model("builtin:tiny-moe")
    adapter = load_adapter(model)
    sweep = CalibrationSweep(model, [], torch.zeros(0, dtype=torch.long), [], progress=False)
    layer = adapter.moe_layers()[0]
    _, moe = sweep.materialise(layer)
    hidden = torch.randn(40, moe.gate_up.shape[-1], generator=torch.Generator().manual_seed(1))
    ids, weights = adapter.routing_rule().route(adapter.router_logits(moe, hidden), moe.correction_bias)
    experts = ViewExperts(adapter)
    experts.source = ExpertSource(moe)
    torch.testing.assert_close(experts(hidden, ids, weights), adapter.moe_forward(moe, hidden), rtol=1e-5, atol=1e-6)
    quantized = quantize_experts_rtn(moe, QuantScheme("int4", 32, True))
    experts.source = ExpertSource(quantized.weights, quantized.dequantized_expert)
    expected = adapter.moe_forward(quantized.dequantized(), hidden)
    torch.testing.assert_close(experts(hidden, ids, weights), expected, rtol=1e-5, atol=1e-6)


def test_a_recipe_file_with_both_kinds_parses_through_the_registry():
    from moecompress.passes.registry import PASSES
    from moecompress.runner.recipes import pass_names

    assert pass_names() == (*PASSES, "lowrank", "eval")
    assert {name for name, entry in PASSES.items() if entry.kind == "layer"} == {"prune_experts", "quantize"}
    document = yaml.safe_load(DEFAULT.read_text())
    assert [name for name, _ in parse_recipe(document).passes] == ["prune_experts", "quantize"]
