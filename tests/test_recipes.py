"""Recipes: validated whole before any work (errors name the key's path, exit 2), run pass after pass with the
same results as the passes run by hand."""

import json
from pathlib import Path

import pytest
import yaml
from helpers import run_cli

from moecompress.errors import UserInputError
from moecompress.hub.card import human_bytes
from moecompress.passes.prune_experts import PruneExpertsConfig, prune_experts
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint
from moecompress.runner.recipes import load_recipe, parse_recipe, run_recipe

DEFAULT = Path(__file__).parent.parent / "recipes" / "default.yaml"


def _recipe(*passes, **top):
    return {"model": "builtin:tiny-moe", **top, "passes": list(passes)}


def test_the_default_recipe_is_maep_mxfp4_lowrank_and_eval():
    recipe = load_recipe(DEFAULT)
    assert [name for name, _ in recipe.passes] == ["prune_experts", "quantize"]
    prune, quantize = (config for _, config in recipe.passes)
    assert prune.method == "maep" and prune.ratio == 0.25
    assert quantize.scheme == "mxfp4" and quantize.lowrank_budget == 0.375
    assert recipe.evaluation is not None and recipe.model == "builtin:tiny-moe"


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (_recipe({"quantize": {}}, modle="x"), "modle: unknown key"),
        (_recipe({"quantize": {"schem": "int4"}}), "passes[0].quantize.schem: unknown key"),
        (_recipe({"prune_experts": {"ratio": "a lot"}}), "passes[0].prune_experts.ratio a lot is not a number"),
        (_recipe({"prune_experts": {"scope": "everywhere"}}), "passes[0].prune_experts.scope everywhere is not one of"),
        (_recipe({"prune_experts": {"ratio": 1.5}}), "passes[0].prune_experts.ratio 1.5 must be between 0 and 1"),
        (_recipe({"quantize": {"scheme": "int3"}}), "passes[0].quantize.scheme int3 is not one of mxfp4"),
        (_recipe({"quantize": {}}, {"prune_experts": {}}), "passes[1].prune_experts: pruning must come before"),
        (_recipe({"quantize": {}}, {"qat": {}}), "passes[1].qat: the model is already quantised by passes[0].quantize"),
        (_recipe({"lowrank": {"lowrank_budget": 0.5}}), "passes[0].lowrank: lowrank must directly follow"),
        (_recipe({"quantize": {}}, {"lowrank": {"budget": 1}}), "passes[1].lowrank.budget: unknown key"),
        (_recipe({"eval": {}}, {"quantize": {}}), "passes[1].quantize: eval must be the last pass"),
        (_recipe({"teleport": {}}), "passes[0].teleport: unknown pass"),
        (_recipe(), "passes: expected a non-empty list"),
        (
            _recipe({"quantize": {}}, calibration={"tokens": 10, "seq_len": 256}),
            "calibration.tokens 10 is less than one window of calibration.seq_len 256",
        ),
        (
            _recipe({"qat": {"quantize": {"group_size": "big"}}}),
            "passes[0].qat.quantize.group_size big is not a whole number",
        ),
    ],
)
def test_bad_recipes_name_the_key(document, message):
    with pytest.raises(UserInputError) as raised:
        parse_recipe(document)
    assert message in str(raised.value)


def test_the_cli_refuses_a_bad_recipe_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_recipe({"quantize": {"scheme": "mxfp4", "method": "magic"}})))
    result = run_cli("run", str(bad), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and not (tmp_path / "out").exists()
    assert result.stderr.strip().count("\n") == 0 and "passes[0].quantize.method" in result.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("passes: [quantize: {")
    result = run_cli("run", str(broken), "--dry-run")
    assert result.returncode == 2 and "not valid YAML" in result.stderr


def test_a_chained_recipe_gives_the_same_checkpoint_as_its_passes_run_by_hand(tiny_with_tokenizer, tmp_path):
    """``chained`` runs each pass as its own checkpoint-to-checkpoint job, as recipes ran before the pipeline (the
    pipeline's own equivalences are in test_pipeline.py)."""
    source = tiny_with_tokenizer["qwen3_moe"]
    document = _recipe(
        {"prune_experts": {"ratio": 0.25}},
        {"quantize": {"scheme": "int4"}},
        {"lowrank": {"lowrank_budget": 0.5}},
        calibration={"tokens": 1024, "seq_len": 64},
    )
    report = run_recipe(parse_recipe(document), source, tmp_path / "recipe", progress=False, chained=True)
    assert report["recipe"]["passes"][1] == "quantize: scheme=int4, method=rtn, format=native, lowrank_budget=0.5"
    common = dict(calib="builtin:prose", calib_tokens=1024, seq_len=64, progress=False)
    prune_experts(source, tmp_path / "pruned", PruneExpertsConfig(ratio=0.25), **common)
    quantize_checkpoint(
        tmp_path / "pruned", tmp_path / "hand", QuantizeConfig(scheme="int4", lowrank_budget=0.5), **common
    )
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "recipe" / name).read_bytes() == (tmp_path / "hand" / name).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hand", "pruned", "recipe"]  # intermediates removed


def _small_recipe(tmp_path):
    recipe = tmp_path / "small.yaml"
    recipe.write_text(
        yaml.safe_dump(
            _recipe(
                {"prune_experts": {"ratio": 0.25}},
                {"quantize": {"scheme": "mxfp4"}},
                {"eval": {"tokens": 1024}},
                calibration={"tokens": 1024, "seq_len": 128},
            )
        )
    )
    return recipe


def test_run_prints_the_summary_and_report_reprints_and_plots_it(tmp_path):
    out = tmp_path / "out"
    result = run_cli("run", str(_small_recipe(tmp_path)), "--out", str(out), "--quiet")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    experts_row = next(line for line in lines if line.startswith("routed experts"))
    assert experts_row.split()[2:4] == ["32", "24"]
    report = json.loads((out / "moecompress_report.json").read_text())
    outcome = report["outcome"]
    assert outcome["experts"] == [32, 24] and outcome["perplexity"][0] == report["eval"]["reference_perplexity"]
    assert outcome["bytes"][1] < outcome["bytes"][0] and [p["pass"] for p in report["previous_passes"]] == [
        "prune_experts"
    ]
    assert set(report["versions"]) == {"moecompress", "torch", "transformers"}
    assert "predicted tokens in windows of 128" in lines[-1] and f"{report['eval']['tokens']:,}" in lines[-1]
    _assert_names_the_real_input(out, report)
    again = run_cli("report", str(out), "--plot", str(tmp_path / "size.png"))
    assert again.returncode == 0, again.stderr
    assert experts_row in again.stdout and f"{outcome['perplexity'][1]:.3f}" in again.stdout
    assert (tmp_path / "size.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = run_cli("report", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "no such directory" in missing.stderr


def _assert_names_the_real_input(out, report):
    """A multi-pass output's report and card name the recipe's input and every pass, and measure bytes against the
    input, not against the hidden step directory the last pass read (issue 32, item 4)."""
    from moecompress.checkpoint import resolve_model
    from moecompress.evals.footprint import checkpoint_footprint

    source = str(resolve_model("builtin:tiny-moe"))
    assert report["source"] == source and report["previous_passes"][0]["source"] == source
    assert report["source_footprint"]["file_bytes"] == checkpoint_footprint(Path(source)).file_bytes
    assert ".run" not in json.dumps(report)
    card = run_cli("push", str(out), "--repo-id", "me/t", "--dry-run")
    assert card.returncode == 0, card.stderr
    assert "step-" not in card.stdout and ".run" not in card.stdout
    assert "A compressed copy of `builtin:tiny-moe`" in card.stdout
    assert "prune_experts:" in card.stdout and "quantize:" in card.stdout and "Removed" in card.stdout
    input_size = next(line for line in card.stdout.splitlines() if line.startswith("| weights on disk"))
    assert input_size.split("|")[2].strip() == human_bytes(checkpoint_footprint(Path(source)).file_bytes)
    assert "| routed experts, all layers | 32 | 24 |" in card.stdout


def test_log_json_gives_one_json_object_per_stderr_line(tmp_path):
    result = run_cli("run", str(_small_recipe(tmp_path)), "--out", str(tmp_path / "out"), "--log-json")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stderr.splitlines()]
    kinds = {record["event"] for record in records}
    assert {"pass", "progress", "summary"} <= kinds and all("time" in record for record in records)
    ends = [r for r in records if r["event"] == "pass" and r["state"] == "end"]
    assert [r["name"] for r in ends] == ["prune_experts", "quantize"]
    summary = next(r for r in records if r["event"] == "summary")
    assert summary["outcome"]["experts"] == [32, 24]
    both = run_cli("run", str(_small_recipe(tmp_path)), "--out", str(tmp_path / "x"), "--quiet", "--log-json")
    assert both.returncode == 2 and "exclude each other" in both.stderr


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (_recipe({"quantize": {"method": "rtn", "gptq_damp": 0.01}}), "passes[0].quantize.gptq_damp 0.01 applies only"),
        (_recipe({"quantize": {"scheme": "mxfp4", "symmetric": False}}), "passes[0].quantize.symmetric false"),
        (_recipe({"quantize": {"scheme": "int4", "scale_rule": "ceil"}}), "passes[0].quantize.scale_rule ceil"),
        (_recipe({"quantize": {}}, {"lowrank": {"rank_alloc": "uniform"}}), "passes[1].lowrank.rank_alloc uniform"),
        (_recipe({"quantize": {}}, {"lowrank": {"lowrank_budget": float("nan")}}), "lowrank_budget nan is not a fin"),
        (_recipe({"prune_experts": {"min_keep": 3}}), "passes[0].prune_experts.min_keep 3 applies only with"),
        (_recipe({"prune_experts": {"method": "reap", "greedy": True}}), "passes[0].prune_experts.greedy true"),
        (_recipe({"prune_experts": {"greedy_step": 2}}), "passes[0].prune_experts.greedy_step 2 applies only"),
        (_recipe({"prune_experts": {"ratio": float("inf")}}), "passes[0].prune_experts.ratio inf is not a finite"),
        (_recipe({"prune_heads": {"method": "magnitude", "steps": 5}}), "passes[0].prune_heads.steps 5 applies"),
        (_recipe({"qat": {"replay_weights": "recorded"}}), "passes[0].qat.replay_weights recorded applies only"),
        (
            _recipe({"qat": {"quantize": {"scheme": "mxfp4", "symmetric": True, "lowrank_budget": 0.375}}}),
            "passes[0].qat.quantize.symmetric true applies only",
        ),
        (_recipe({"quantize": {}}, calibration={"tokens": 4096}), "calibration.tokens applies only with a pass"),
        (_recipe({"quantize": {}}, calibration={"seq_len": 128}), "calibration.seq_len applies only with"),
        (_recipe({"prune_experts": {}}, calibration={"image_size": 64}), "calibration.image_size applies only"),
        (_recipe({"quantize": {}}, {"eval": {"tokens": 1}}), "passes[1].eval.tokens 1 must be at least 2"),
        (_recipe({"quantize": {"targets": ["experts", 7]}}), "passes[0].quantize.targets"),
        (_recipe({"quantize": {"x" * 500: 1}}), "..."),
    ],
)
def test_keys_a_pass_ignores_and_values_no_pass_can_use_are_refused_by_path(document, message):
    with pytest.raises(UserInputError) as raised:
        parse_recipe(document)
    assert message in str(raised.value) and len(str(raised.value)) < 400, str(raised.value)


def test_a_key_that_applies_is_accepted():
    recipe = parse_recipe(_recipe({"quantize": {"scheme": "int4", "symmetric": False, "method": "gptq"}}))
    assert recipe.passes[0][1].symmetric is False


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "model: builtin:tiny-moe\npasses: [{quantize: {}}]\npasses: [{prune_experts: {}}]\n",
            "duplicate key 'passes'",
        ),
        ("model: builtin:tiny-moe\npasses:\n  - quantize: {scheme: int4, scheme: int2}\n", "duplicate key 'scheme'"),
        ("model: a\nmodel: b\npasses: [{quantize: {}}]\n", "line 2, column 1: duplicate key 'model' (first on line 1)"),
        ("model: &m builtin:tiny-moe\nx: *m\npasses: [{quantize: {}}]\n", "alias *m: recipes do not take YAML aliases"),
    ],
)
def test_duplicate_keys_and_aliases_are_refused(tmp_path, text, message):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(UserInputError) as raised:
        load_recipe(path)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_an_alias_bomb_is_refused_in_bounded_memory_with_a_short_line(tmp_path):
    """The issue's 365-byte bomb grew to a 580 MB message and 2.6 GB RSS (the value's repr in ``model:``'s
    message); aliases are refused at the first one."""
    import resource

    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 9)}]" for i in range(8)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\nmodel: *i\npasses: [{quantize: {}}]\n")
    assert path.stat().st_size < 500
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(UserInputError) as raised:
        load_recipe(path)
    assert "aliases" in str(raised.value) and len(str(raised.value)) < 200
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KiB
