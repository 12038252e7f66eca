"""Issue 40: ``--overwrite`` deletes only what moecompress wrote, no command writes inside its input, and one run at
a time writes an output (a lock beside it that a killed run does not leave held)."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import moecompress
from moecompress.checkpoint import resolve_model
from moecompress.errors import UserInputError
from moecompress.runner import lock as run_lock

_SPEC = importlib.util.spec_from_file_location(
    "bad_input_table", Path(__file__).parent.parent / "scripts" / "bad_input_table.py"
)
table = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("bad_input_table", table)
_SPEC.loader.exec_module(table)

TINY = "builtin:tiny-moe"
QUICK = ["--no-eval", "--quiet"]


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _refused(outcome, fragment: str) -> None:
    lines = outcome.stderr.strip().splitlines()
    assert outcome.code == 2 and len(lines) == 1 and fragment in lines[0], outcome.stderr
    assert "Traceback" not in outcome.stderr


def _project(directory: Path) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "notes.txt").write_text("mine\n")
    (directory / "src").mkdir()
    (directory / "src" / "main.py").write_text("print('mine')\n")


@pytest.mark.parametrize("out", [".", "", ".."])
def test_overwrite_never_replaces_the_working_directory_or_one_above(out, tmp_path, monkeypatch):
    here = tmp_path / "work"
    _project(here)
    monkeypatch.chdir(here)
    before = _files(tmp_path)
    outcome = table.run_case(["quantize", TINY, "--out", out, "--overwrite", *QUICK])
    _refused(outcome, "the working directory")
    assert _files(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_overwrite_never_replaces_a_folder_of_other_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _project(tmp_path / "proj")
    before = _files(tmp_path)
    for command in (["quantize", TINY, *QUICK], ["export", TINY, "--format", "bf16"]):
        outcome = table.run_case([*command, "--out", "proj", "--overwrite"])
        _refused(outcome, "not a moecompress output")
        assert _files(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["proj"]
    (tmp_path / "link").symlink_to("proj")
    _refused(table.run_case(["quantize", TINY, "--out", "link", "--overwrite", *QUICK]), "a symbolic link")
    assert _files(tmp_path / "proj") == {k[len("proj/") :]: v for k, v in before.items()}
    (tmp_path / "afile").write_text("mine\n")
    _refused(table.run_case(["run", table.DEFAULT_RECIPE, "--out", "afile", "--overwrite"]), "afile")
    assert (tmp_path / "afile").read_text() == "mine\n"


def test_overwrite_replaces_an_earlier_output_and_an_empty_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert table.run_case(["quantize", TINY, "--out", "out", *QUICK]).code == 0
    first = (tmp_path / "out" / "moecompress_report.json").read_text()
    outcome = table.run_case(["quantize", TINY, "--out", "out", "--overwrite", "--scheme", "int4", *QUICK])
    assert outcome.code == 0, outcome.stderr
    second = json.loads((tmp_path / "out" / "moecompress_report.json").read_text())
    assert second != json.loads(first) and "int4" in json.dumps(second)
    (tmp_path / "empty").mkdir()
    assert table.run_case(["quantize", TINY, "--out", "empty", "--overwrite", *QUICK]).code == 0
    assert (tmp_path / "empty" / "moecompress_report.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out"]


def test_the_api_names_its_arguments_and_keeps_the_files(tmp_path):
    _project(tmp_path / "proj")
    before = _files(tmp_path)
    with pytest.raises(UserInputError, match=r"^quantize\(\): out='.*proj': not a moecompress output.*overwrite=True"):
        moecompress.quantize(TINY, tmp_path / "proj", overwrite=True, evaluation=None)
    (tmp_path / "done").mkdir()
    with pytest.raises(
        UserInputError, match=r"^quantize\(\): .*done: output directory exists \(pass overwrite=True to replace it\)$"
    ):
        moecompress.quantize(TINY, tmp_path / "done", evaluation=None)
    assert _files(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done", "proj"]
    (tmp_path / "done" / "moecompress_report.json").write_text("{}\n")
    (tmp_path / "done" / "notes.txt").write_text("calibration text\n" * 2000)
    before = _files(tmp_path)
    with pytest.raises(UserInputError, match=r"notes.txt: an input inside .*done, which overwriting it would delete"):
        moecompress.prune(
            TINY,
            tmp_path / "done",
            overwrite=True,
            calibration={"source": str(tmp_path / "done" / "notes.txt"), "tokens": 256},
            evaluation=None,
        )
    assert _files(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done", "proj"]


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory):
    import shutil

    target = tmp_path_factory.mktemp("input") / "m"
    shutil.copytree(resolve_model(TINY), target)
    return target


def test_no_command_writes_inside_its_input(model_copy, tmp_path, monkeypatch):
    """eval's --json-out onto the model's own config.json (the issue's case), into the reference, or onto the
    evaluation data; report's --plot into a run; export's --out into the model: each refused, nothing changed, and
    the model still inspects."""
    data = tmp_path / "data.txt"
    data.write_text("some text to evaluate on\n" * 200)
    before, data_before = _files(model_copy), data.read_bytes()
    monkeypatch.chdir(model_copy)
    for argv in (
        ["eval", str(model_copy), "--json-out", str(model_copy / "config.json")],
        ["eval", str(model_copy), "--json-out", "config.json"],
        ["eval", TINY, "--reference", str(model_copy), "--json-out", str(model_copy / "sub" / "eval.json")],
        ["eval", TINY, "--eval-data", str(data), "--json-out", str(data)],
        ["report", str(model_copy), "--plot", str(model_copy / "plot.png")],
        ["export", str(model_copy), "--format", "gguf", "--out", str(model_copy / "m.gguf")],
        ["export", str(model_copy), "--format", "bf16", "--out", str(model_copy / "plain")],
        ["quantize", str(model_copy), "--out", str(model_copy / "q"), *QUICK],
    ):
        outcome = table.run_case(argv)
        assert outcome.code == 2 and len(outcome.stderr.strip().splitlines()) == 1, (argv, outcome.stderr)
        assert "input" in outcome.stderr, (argv, outcome.stderr)
    assert _files(model_copy) == before and data.read_bytes() == data_before
    assert table.run_case(["inspect", str(model_copy)]).code == 0


def _hold_in_another_process(out: Path) -> subprocess.Popen:
    """A process holding ``out``'s lock until its stdin closes (or it is killed)."""
    code = (
        "import sys; from moecompress.runner import lock as run_lock; "
        f"run_lock.acquire({str(out)!r}); print('held', flush=True); sys.stdin.read()"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.mark.parametrize("after_the_kill", ["--resume", "--restart"])
def test_a_live_run_refuses_a_second_run_a_resume_and_a_restart_then_a_kill_frees_it(
    after_the_kill, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    holder = _hold_in_another_process(tmp_path / "out")
    try:
        (tmp_path / ".out.run").mkdir()
        before = _files(tmp_path)
        for extra in ([], ["--resume"], ["--restart"], ["--overwrite"]):
            outcome = table.run_case(["quantize", TINY, "--out", "out", *QUICK, *extra])
            _refused(outcome, f"another moecompress run (pid {holder.pid}: python -c")
            assert _files(tmp_path) == before and (tmp_path / ".out.run").is_dir()
        with pytest.raises(
            UserInputError, match=rf"^quantize\(\): out='.*out': another moecompress run \(pid {holder.pid}"
        ):
            moecompress.quantize(TINY, tmp_path / "out", resume=True, evaluation=None)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / ".out.lock").exists(), "a killed holder leaves its lock file, which must not block"
    outcome = table.run_case(["quantize", TINY, "--out", "out", after_the_kill, *QUICK])
    assert outcome.code == 0, outcome.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_two_real_runs_on_one_out(tmp_path, monkeypatch):
    """The first run holds the lock from its output checks on (the whole run, seconds, where the second's refusal
    takes a fraction of one); a second run started meanwhile is refused naming the first's pid and touches nothing;
    the first finishes as if alone and leaves no lock or work directory behind."""
    monkeypatch.chdir(tmp_path)
    command = ["quantize", TINY, "--out", "out", *QUICK]
    first = subprocess.Popen(
        [sys.executable, "-m", "moecompress.cli.main", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lock = tmp_path / ".out.lock"
    deadline = time.monotonic() + 240
    while not (lock.exists() and lock.read_text().startswith(f"{first.pid}\n")):
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "the first run never took its lock"
        time.sleep(0.05)
    second = table.run_case(command)
    still_running = first.poll() is None
    _refused(second, f"another moecompress run (pid {first.pid}: ")
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0 and "wrote out in" in stdout, stderr
    assert still_running, "the first run ended before the second was refused; the test proved nothing"
    assert (tmp_path / "out" / "moecompress_report.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_lock_file_is_removed_on_release_and_a_stale_one_is_taken_over(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    run_lock.acquire(out)
    assert run_lock.lock_path(out).read_text().split("\n")[0] == str(os.getpid())
    run_lock.acquire(out)
    run_lock.release(out)
    assert not (tmp_path / "a").exists(), "the parents made for the lock file are removed with it"
    run_lock.lock_path(tmp_path / "out").write_text("999999999\nmoecompress killed\n")
    with run_lock.releasing(tmp_path / "out"):
        run_lock.acquire(tmp_path / "out")
        assert run_lock.lock_path(tmp_path / "out").read_text().startswith(f"{os.getpid()}\n")
    assert list(tmp_path.iterdir()) == []
