"""The Python API: typed results, outputs stock transformers loads, the CLI's options and errors, no side effects
of ``import moecompress``."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import run_cli, tree_hashes

import moecompress
from moecompress.errors import UserInputError
from moecompress.evals.perplexity import EvalResult
from moecompress.passes.prune_experts import PruneExpertsConfig
from moecompress.passes.quantize import QuantizeConfig

CALIBRATION = {"tokens": 512, "seq_len": 64}


def _forward(directory) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    with torch.inference_mode():
        return model(input_ids=torch.arange(16)[None]).logits


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    out = tmp_path_factory.mktemp("api") / "pruned"
    return moecompress.prune(
        "builtin:tiny-moe", out, method="maep", ratio=0.25, calibration=CALIBRATION, evaluation={"tokens": 512}
    )


def test_prune_then_quantize_from_the_api_and_load_the_results(pruned, tmp_path, capfd):
    assert isinstance(pruned, moecompress.PruneResult) and isinstance(pruned.config, PruneExpertsConfig)
    assert pruned.out.is_dir() and pruned.out.is_absolute()
    assert (pruned.experts_before, pruned.experts_after) == (32, 24) and pruned.uniform
    for layer, kept in pruned.kept.items():
        assert len(kept) == 6 and sorted(kept + pruned.removed[layer]) == list(range(8))
    assert pruned.bytes_after < pruned.bytes_before
    assert pruned.bits_per_weight_after == pruned.bits_per_weight_before == 16.0
    assert isinstance(pruned.evaluation, EvalResult)
    assert pruned.evaluation.reference_perplexity < pruned.evaluation.perplexity
    assert 0 < pruned.evaluation.routing_agreement < 1 and pruned.evaluation.kl > 0
    report = json.loads((pruned.out / "moecompress_report.json").read_text())
    assert report["layers"]["0"]["kept"] == list(pruned.kept[0])

    capfd.readouterr()
    quantized = moecompress.quantize(pruned.out, tmp_path / "q", scheme="mxfp4", evaluation=None)
    assert capfd.readouterr().err == ""
    assert isinstance(quantized, moecompress.QuantizeResult) and isinstance(quantized.config, QuantizeConfig)
    assert quantized.evaluation is None and quantized.scheme.startswith("mxfp4")
    assert quantized.bytes_before == pruned.bytes_after
    # MXFP4: a 4-bit code per weight and an 8-bit scale per 32 weights.
    assert quantized.expert_bits_per_weight_after == 4 + 8 / 32
    assert quantized.bits_per_weight_after < quantized.bits_per_weight_before
    assert quantized.quantized_modules == 4 and quantized.rtn_fallback_experts == {}

    reference = _forward(moecompress.api._resolve("builtin:tiny-moe"))
    for directory in (pruned.out, quantized.out):
        logits = _forward(directory)
        assert logits.shape == reference.shape and torch.isfinite(logits).all()
        assert not torch.equal(logits, reference)


def test_the_api_writes_what_the_cli_writes(pruned, tmp_path):
    result = run_cli(
        "prune", "builtin:tiny-moe", "--out", str(tmp_path / "cli"), "--method", "maep", "--ratio", "0.25",
        "--calib-tokens", "512", "--seq-len", "64", "--eval-tokens", "512", "-q",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    cli, api = tree_hashes(tmp_path / "cli"), tree_hashes(pruned.out)
    assert cli.pop("moecompress_report.json") and api.pop("moecompress_report.json")
    assert cli == api
    # The evaluation's float sums may round differently with the other process's thread count.
    cli_eval = json.loads((tmp_path / "cli" / "moecompress_report.json").read_text())["eval"]
    assert cli_eval.pop("data") == pruned.report["eval"]["data"]
    assert cli_eval == pytest.approx({k: v for k, v in pruned.report["eval"].items() if k != "data"}, rel=1e-6)


def test_evaluate_returns_an_eval_result_equal_to_the_pass_evaluation(pruned):
    result = moecompress.evaluate(pruned.out, "builtin:tiny-moe", data="builtin:prose", seq_len=64, max_tokens=512)
    assert isinstance(result, EvalResult) and result.tokens_per_second > 0
    for name in ("perplexity", "kl", "routing_agreement", "reference_perplexity", "tokens", "windows"):
        assert getattr(result, name) == pytest.approx(getattr(pruned.evaluation, name), rel=1e-6), name
    alone = moecompress.evaluate("builtin:tiny-moe", data="builtin:prose", seq_len=64, max_tokens=512)
    assert alone.kl is None and alone.perplexity == pytest.approx(result.reference_perplexity, rel=1e-6)


def test_run_takes_a_recipe_as_a_dict(tmp_path):
    recipe = {
        "model": "builtin:tiny-moe",
        "calibration": CALIBRATION,
        "passes": [
            {"prune_experts": {"method": "frequency", "keep": 6, "ratio": None}},
            {"quantize": {"scheme": "int4"}},
        ],
    }
    result = moecompress.run(recipe, out=tmp_path / "r")
    assert isinstance(result, moecompress.RunResult) and result.evaluation is None
    assert result.passes[0].startswith("prune_experts:") and result.passes[1].startswith("quantize:")
    assert (result.experts_before, result.experts_after) == (32, 24)
    # INT4, groups of 32 with a 16-bit scale each.
    assert result.expert_bits_per_weight_after == 4 + 16 / 32
    assert torch.isfinite(_forward(result.out)).all()


def test_run_takes_a_recipe_file_and_a_model_override(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model: some/other-model\npasses:\n  - quantize: {scheme: int2}\n")
    result = moecompress.run(recipe, out=tmp_path / "r", model="builtin:tiny-moe")
    assert len(result.passes) == 1 and result.passes[0].startswith("quantize: scheme=int2")
    assert result.report["recipe"]["model"] == str(moecompress.api._resolve("builtin:tiny-moe"))
    assert result.expert_bits_per_weight_after < result.expert_bits_per_weight_before


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda out: moecompress.prune("builtin:tiny-moe", out, ratioo=0.3), TypeError, "'ratioo'"),
        (lambda out: moecompress.quantize("builtin:tiny-moe", out, scheme="int3"), UserInputError, "int3"),
        (lambda out: moecompress.quantize("builtin:tiny-moe", out, group_size="32"), UserInputError, "group_size"),
        (lambda out: moecompress.prune("builtin:tiny-moe", out, ratio=1.5), UserInputError, "ratio"),
        (lambda out: moecompress.prune("builtin:tiny-moe", out, calibration={"tokenz": 1}), UserInputError, "tokenz"),
        (lambda out: moecompress.prune("builtin:tiny-moe", out, evaluation={"tokens": "x"}), UserInputError, "tokens"),
        (lambda out: moecompress.quantize("builtin:nothing", out), UserInputError, "builtin:nothing"),
        (lambda out: moecompress.run({"passes": [{"quantise": {}}]}, out=out), UserInputError, "quantise"),
        (lambda out: moecompress.evaluate("builtin:tiny-moe", data="builtin:poetry"), UserInputError, "poetry"),
        (
            lambda out: moecompress.evaluate("builtin:tiny-moe", seq_len=10**6, max_tokens=None),
            UserInputError,
            "max_position",
        ),
    ],
)
def test_a_wrong_option_is_refused_before_any_work(tmp_path, monkeypatch, call, error, message):
    import moecompress.runner.recipes

    def no_work(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(moecompress.runner.recipes, "run_recipe", no_work)
    with pytest.raises(error, match=message):
        call(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_partial_work_is_refused_unless_resume_or_restart(tmp_path, monkeypatch):
    import moecompress.runner.recipes

    class Started(Exception):
        pass

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(moecompress.runner.recipes, "run_recipe", started)
    partial = tmp_path / ".out.run"
    partial.mkdir()
    with pytest.raises(UserInputError, match="partial work"):
        moecompress.quantize("builtin:tiny-moe", tmp_path / "out", evaluation=None)
    assert partial.is_dir()
    with pytest.raises(Started):
        moecompress.quantize("builtin:tiny-moe", tmp_path / "out", evaluation=None, resume=True)
    assert partial.is_dir()
    with pytest.raises(UserInputError, match="keep"):
        moecompress.prune("builtin:tiny-moe", tmp_path / "out", keep=100, evaluation=None, restart=True)
    assert partial.is_dir(), "a refused run discarded the partial work"
    with pytest.raises(Started):
        moecompress.quantize("builtin:tiny-moe", tmp_path / "out", evaluation=None, restart=True)
    assert not partial.exists()


def test_import_sets_no_process_state_and_the_cli_sets_huge_pages():
    check = (
        "import os, sys; before = dict(os.environ); import moecompress; "
        "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items()); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules; "
        "import moecompress.cli.main; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    )
    env = {key: value for key, value in os.environ.items() if key != "THP_MEM_ALLOC_ENABLE"}
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"


def _cli_message(args) -> str:
    from moecompress.cli.main import app

    with pytest.raises(UserInputError) as raised:
        app.main(list(args), standalone_mode=False)
    return str(raised.value)


def _recipe_message(tmp_path, text) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text("model: builtin:tiny-moe\n" + text)
    return _cli_message(["run", str(path), "--out", str(tmp_path / "r")])


def _api_message(call, **kwargs) -> str:
    with pytest.raises(UserInputError) as raised:
        call(**kwargs)
    return str(raised.value)


@pytest.mark.parametrize(
    ("cli", "recipe", "api", "names"),
    [
        (
            ["eval", "builtin:tiny-moe", "--seq-len", "100000"],
            "calibration: {seq_len: 100000, tokens: 200000}\npasses: [{prune_experts: {}}]\n",
            (moecompress.evaluate, {"model": "builtin:tiny-moe", "seq_len": 100000}),
            ("--seq-len 100000", "calibration.seq_len 100000", "evaluate(): seq_len=100000"),
        ),
        (
            ["quantize", "builtin:tiny-moe", "--lowrank-budget", "12"],
            "passes: [{quantize: {}}, {lowrank: {lowrank_budget: 12}}]\n",
            (moecompress.quantize, {"lowrank_budget": 12.0}),
            ("--lowrank-budget 12.0", "passes[1].lowrank.lowrank_budget 12.0", "quantize(): lowrank_budget=12.0"),
        ),
        (
            ["quantize", "builtin:tiny-moe", "--gptq-damp", "0.1"],
            "passes: [{quantize: {gptq_damp: 0.1}}]\n",
            (moecompress.quantize, {"gptq_damp": 0.1}),
            ("--gptq-damp 0.1", "passes[0].quantize.gptq_damp 0.1", "quantize(): gptq_damp=0.1"),
        ),
        (
            ["prune", "builtin:tiny-moe", "--keep", "9"],
            "passes: [{prune_experts: {keep: 9}}]\n",
            (moecompress.prune, {"keep": 9}),
            ("--keep 9", "passes[0].prune_experts.keep 9", "prune(): keep=9"),
        ),
        (
            ["prune", "builtin:tiny-moe", "--ratio", "0.25", "--calib-tokens", "100"],
            "calibration: {tokens: 100}\npasses: [{prune_experts: {ratio: 0.25}}]\n",
            (moecompress.prune, {"ratio": 0.25, "calibration": {"tokens": 100}}),
            ("--calib-tokens 100", "calibration.tokens 100", "prune(): calibration={'tokens': 100}"),
        ),
        (
            ["prune", "builtin:tiny-moe", "--scope", "layer", "--min-keep", "3"],
            "passes: [{prune_experts: {scope: layer, min_keep: 3}}]\n",
            (moecompress.prune, {"scope": "layer", "min_keep": 3}),
            ("--min-keep 3", "passes[0].prune_experts.min_keep 3", "prune(): min_keep=3"),
        ),
    ],
    ids=["seq_len", "lowrank_budget", "gptq_damp", "keep", "calib_tokens", "min_keep"],
)
def test_the_same_bad_value_is_named_as_each_caller_spells_it(tmp_path, cli, recipe, api, names):
    """Issue 40: a refusal names the option as the caller wrote it: the flag, the recipe key's path, the argument."""
    call, kwargs = api
    if call is not moecompress.evaluate:
        kwargs = {"model": "builtin:tiny-moe", "out": tmp_path / "a", "evaluation": None, **kwargs}
        cli = [*cli, "--out", str(tmp_path / "c"), "--no-eval"]
    messages = (_cli_message(cli), _recipe_message(tmp_path, recipe), _api_message(call, **kwargs))
    for message, name in zip(messages, names, strict=True):
        assert message.startswith(name), (message, name)
    assert "passes[" not in messages[0] + messages[2] and "--" not in messages[1] + messages[2], messages
    assert "max_tokens" not in messages[2], messages
    assert not any(p.exists() for p in (tmp_path / "a", tmp_path / "c", tmp_path / "r"))


def test_evaluate_blames_the_window_not_a_default_the_caller_did_not_set():
    """A window longer than the default token count names the window, which the caller set, and says the count is
    a default; a count the caller gave is named itself."""
    from moecompress.errors import OptionError
    from moecompress.runner.preflight import check_eval_window
    from moecompress.vocabulary import Arguments

    arguments = Arguments("evaluate", {("calibration", "seq_len"): "seq_len", ("evaluation", "tokens"): "max_tokens"})
    with pytest.raises(OptionError) as raised:
        check_eval_window(20000, 16384, given=False)
    assert str(raised.value).startswith("--seq-len 20000 is longer than the 16384 tokens evaluated by default")
    assert str(arguments.bind(raised.value)).startswith("evaluate(): seq_len=20000 is longer than the 16384 tokens")
    with pytest.raises(UserInputError) as raised:
        moecompress.evaluate("builtin:tiny-moe", seq_len=512, max_tokens=100)
    assert str(raised.value).startswith("evaluate(): max_tokens=100 is less than one window of seq_len=512")
