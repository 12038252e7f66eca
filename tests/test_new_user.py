"""What a new user hit (issue 32), beyond the bad-input table: partial work kept until asked, start lines shown
while a slow first layer runs, one evaluation default, one option vocabulary with help everywhere, warnings for
replaced characters, the plan header, the packaging and the report plot."""

import json
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from moecompress import progress
from moecompress.cli.main import app
from moecompress.defaults import DEFAULT_EVAL_TOKENS
from moecompress.errors import UserInputError
from moecompress.runner.preflight import check_partial_work, discard_partial_work
from moecompress.runner.recipes import Evaluation, describe, load_recipe

ROOT = Path(__file__).parent.parent


def _commands(group: click.Group, prefix: str = ""):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", command


def test_every_option_of_every_command_has_help():
    missing = [
        f"{name} {param.opts[0]}"
        for name, command in _commands(app)
        for param in command.params
        if isinstance(param, click.Option) and not (param.help or "").strip()
    ]
    assert not missing, missing


def test_one_vocabulary_and_old_spellings_still_parse():
    """--calib is the calibration source, --eval-data / --eval-tokens the evaluation on every command; the old
    --data (qat, prune-heads, eval) and --max-tokens (eval) are accepted and hidden from --help."""
    commands = dict(_commands(app))
    for name in ("prune", "quantize", "qat", "prune-heads"):
        options = {opt for param in commands[name].params for opt in param.opts}
        assert {"--calib", "--calib-tokens", "--seq-len", "--eval-data", "--eval-tokens", "--no-eval"} <= options
        assert {"--resume", "--restart", "--quiet", "--log-json"} <= options, name
        eval_tokens = next(p for p in commands[name].params if p.name == "eval_tokens")
        assert eval_tokens.type.convert(eval_tokens.default, eval_tokens, None) == DEFAULT_EVAL_TOKENS
    assert Evaluation().tokens == DEFAULT_EVAL_TOKENS
    assert load_recipe(ROOT / "recipes" / "default.yaml").evaluation.tokens == DEFAULT_EVAL_TOKENS
    old = {
        "eval": ["builtin:tiny-moe", "--data", "builtin:code", "--max-tokens", "512"],
        "qat": ["M", "--out", "O", "--scheme", "int2", "--data", "builtin:code"],
        "prune-heads": ["M", "--out", "O", "--ratio", "0.5", "--data", "builtin:code"],
    }
    for name, args in old.items():
        context = commands[name].make_context(name, list(args))
        assert context.params.get("calib", context.params.get("data")) == "builtin:code"
        help_text = commands[name].get_help(context)
        assert "--data " not in help_text and "--max-tokens" not in help_text
    evaluated = commands["eval"].make_context("eval", old["eval"]).params
    assert evaluated["max_tokens"] == 512
    assert commands["eval"].make_context("eval", ["M", "--eval-tokens", "all"]).params["max_tokens"] is None


def test_group_size_help_matches_each_scheme():
    from moecompress.kernels import binary, intq
    from moecompress.passes.quantize import GROUP_SIZE_HELP

    assert intq.GROUP_SIZES == (32, 64, 128) and "int4, int2 and w4a8 take 32, 64 or 128" in GROUP_SIZE_HELP
    assert binary.GROUP_SIZES == (32, 64, 128, 256) and "binary 32, 64, 128 or 256" in GROUP_SIZE_HELP
    assert "mxfp4 blocks are always 32 wide and k-quant super-blocks 256, so those refuse any other value" in (
        GROUP_SIZE_HELP
    )
    from moecompress.quantization.schemes import SCHEME_KINDS

    fixed = {name: kind.fixed_group_size for name, kind in SCHEME_KINDS.items() if kind.fixed_group_size}
    assert fixed == {"mxfp4": 32, **{f"q{bits}_k": 256 for bits in range(2, 7)}}


def test_partial_work_is_refused_until_resume_or_restart(tmp_path):
    out = tmp_path / "out"
    partial = tmp_path / ".out.run"
    (partial / "step-0").mkdir(parents=True)
    with pytest.raises(UserInputError, match=r"\.out\.run: partial work .* --resume, or discard it with --restart"):
        check_partial_work(out, resume=False, restart=False)
    assert (partial / "step-0").is_dir()
    check_partial_work(out, resume=True, restart=False)
    assert (partial / "step-0").is_dir()
    check_partial_work(out, resume=False, restart=True)
    assert (partial / "step-0").is_dir()  # removed only once every other check passed
    discard_partial_work(out)
    assert not partial.exists()


def test_restart_discards_the_partial_work_and_runs(tmp_path):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("bad_input_table", ROOT / "scripts" / "bad_input_table.py")
    table = sys.modules.get("bad_input_table") or importlib.util.module_from_spec(spec)
    if "bad_input_table" not in sys.modules:
        sys.modules["bad_input_table"] = table
        spec.loader.exec_module(table)
    (tmp_path / ".out.run" / "step-0").mkdir(parents=True)
    args = ["quantize", "builtin:tiny-moe", "--out", str(tmp_path / "out"), "--no-eval", "--quiet"]
    refused = table.run_case(args)
    assert refused.code == 2 and (tmp_path / ".out.run" / "step-0").is_dir()
    done = table.run_case([*args, "--restart"])
    assert done.code == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_line_mode_shows_start_lines_while_a_slow_first_step_runs(capsys, monkeypatch):
    monkeypatch.setattr(progress, "MODE", "lines")
    monkeypatch.setattr(progress, "HOLD_S", 0.5)
    progress.end_of_command()  # what an earlier test of this process may have left held (in the full suite it did)
    seen = []

    def slow():
        time.sleep(progress.HOLD_S + 0.5)
        seen.append(capsys.readouterr().err)
        yield 1

    progress.event("pass", "pass 1/1: prune_experts started", starting=True)
    for _ in progress.bar(slow(), desc="scoring experts", unit="layer", total=1):
        pass
    assert "pass 1/1: prune_experts started" in seen[0] and "scoring experts: 0/1 layer (0%)" in seen[0]


def test_line_mode_says_100_percent_once(capsys, monkeypatch):
    monkeypatch.setattr(progress, "MODE", "lines")
    monkeypatch.setattr(progress, "LINE_INTERVAL_S", 0.0)
    for _ in progress.bar(range(4), desc="layers", unit="layer"):
        pass
    err = capsys.readouterr().err
    assert err.count("4/4 layer (100%)") == 1, err


def test_a_non_utf8_calibration_file_warns(tmp_path, capsys):
    from moecompress.calibration.sources import load_documents

    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e".encode("latin-1"))
    (document,) = load_documents(str(path))
    assert document.text.count("\ufffd") == 4
    warning = capsys.readouterr().err.strip()
    assert warning.startswith("moecompress: warning:") and "not valid UTF-8" in warning and "4 undecodable" in warning
    (tmp_path / "fine.txt").write_text("café crème")
    load_documents(str(tmp_path / "fine.txt"))
    assert capsys.readouterr().err == ""


def test_the_plan_header_shows_the_options_given():
    (prune, quantize, evaluation) = describe(load_recipe(ROOT / "recipes" / "default.yaml"))
    assert prune == "prune_experts: method=maep, ratio=0.25, scope=layer"
    assert (
        quantize.startswith("quantize: scheme=mxfp4, method=rtn, format=native") and "lowrank_budget=0.375" in quantize
    )
    assert "defaults" not in " ".join([prune, quantize, evaluation])


def test_pip_install_moecompress_does_not_pull_triton():
    """Triton (about 1 GB) is for the GPU kernels and CI's interpreter tests: an extra, never a dependency."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.lower().startswith("triton")]
    assert any(d.startswith("triton") for d in project["optional-dependencies"]["triton"])


def test_outputs_of_the_readme_commands_are_ignored():
    import subprocess

    names = ["tiny-compressed/x", "tiny-pruned/x", "eval.json", "size.png"]
    result = subprocess.run(["git", "check-ignore", *names], cwd=ROOT, capture_output=True, text=True)
    if result.returncode == 128:
        pytest.skip("not a git checkout")
    assert result.stdout.split() == names


def test_report_plot_labels_do_not_overlap():
    """Runs of nearly the same size and perplexity: no two texts of the figure share any area."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from moecompress.runner.summary import draw_runs

    runs = [
        (name, {"bytes": [7.2e6, size], "perplexity": [33.2, ppl]})
        for name, size, ppl in [
            ("tiny-mxfp4", 2.30e6, 34.1),
            ("tiny-mxfp4-gptq", 2.31e6, 34.0),
            ("tiny-int4-g32", 2.35e6, 33.9),
            ("tiny-pruned-mxfp4-lowrank", 2.0e6, 51.0),
        ]
    ]
    figure = draw_runs(runs)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    texts = [t for t in figure.findobj(plt.Text) if t.get_text().strip() and t.get_visible()]
    boxes = [t.get_window_extent(renderer) for t in texts]
    labels = [t.get_text() for t in texts]
    assert all(any(name in label for label in labels) for name, _ in runs)
    overlapping = [
        (labels[i], labels[j])
        for i in range(len(boxes))
        for j in range(i + 1, len(boxes))
        if boxes[i].overlaps(boxes[j])
    ]
    plt.close(figure)
    assert not overlapping, overlapping


def test_inspect_says_when_loading_needs_import_moecompress(tmp_path):
    """Stock transformers refuses these outputs with a size mismatch naming neither cause; inspect names it."""
    import shutil

    from moecompress.checkpoint import resolve_model
    from moecompress.evals.checkpoint_summary import _needs_plugin, summarize

    native = tmp_path / "native"
    shutil.copytree(resolve_model("builtin:tiny-moe"), native)
    config = json.loads((native / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "moecompress"}
    (native / "config.json").write_text(json.dumps(config))
    assert summarize(native)["needs_plugin"] == "moecompress's native quantised format"
    assert summarize(resolve_model("builtin:tiny-moe"))["needs_plugin"] is None
    assert _needs_plugin(None, {6, 7}, {(8, 4)}) == "expert counts that differ by layer"
    assert _needs_plugin(None, {8}, {(8, 4), (6, 3)}) == "attention head counts that differ by layer"
    text = CliRunner().invoke(app, ["inspect", str(native)]).output
    assert "`import moecompress` before from_pretrained" in text


@pytest.mark.parametrize("ending", ["run_recipe", "the eval command", "moecompress.evaluate"])
def test_a_line_held_by_a_command_that_ended_does_not_delay_the_next_commands_lines(ending, capsys, monkeypatch):
    """In one process (a notebook), a start line left held by a command that failed early is forgotten when the
    command ends, whichever entry it came through: it is not printed late, and the next command's start line
    keeps its own short hold."""
    import moecompress
    from moecompress.runner.recipes import run_recipe

    monkeypatch.setattr(progress, "MODE", "lines")
    progress.event("pass", "an earlier command started", starting=True)
    if ending == "run_recipe":
        with pytest.raises(UserInputError):
            run_recipe(load_recipe(ROOT / "recipes" / "default.yaml"), ROOT / "no-such-model", ROOT / "no-such-output")
    elif ending == "the eval command":
        assert isinstance(CliRunner().invoke(app, ["eval", str(ROOT / "no-such-model")]).exception, UserInputError)
    else:
        with pytest.raises(UserInputError):
            moecompress.evaluate(ROOT / "no-such-model")
    monkeypatch.setattr(progress, "HOLD_S", 0.2)
    progress.event("pass", "the next command started", starting=True)
    time.sleep(0.6)
    err = capsys.readouterr().err
    assert "the next command started" in err and "an earlier command started" not in err
