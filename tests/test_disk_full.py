"""A full disk, a quota or a file-size limit met by any file a run writes is one line and exit 2, the partial work
stays, and ``--resume`` (with room again) finishes with the bytes of an uninterrupted run.

Faults are injected in-process at :func:`moecompress.files.write_chunk`, the one function every byte of a run goes
through, for each kind of file; two tests meet real ones: a 1 MiB tmpfs (ENOSPC) and ``RLIMIT_FSIZE`` (EFBIG, with
SIGXFSZ ignored by the CLI)."""

import contextlib
import errno
import io
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import run_cli, tree_hashes

from moecompress import files, progress
from moecompress.cli.main import main

RECIPE = {
    "model": "builtin:tiny-moe",
    "calibration": {"source": "builtin:prose", "tokens": 512, "seq_len": 64, "seed": 3},
    "passes": [
        {"prune_experts": {"method": "maep", "ratio": 0.25}},
        {"quantize": {"scheme": "int4", "method": "gptq"}},
        {"lowrank": {"lowrank_budget": 0.5, "sensitivity": "fisher-token"}},
        {"eval": {"data": "builtin:prose", "tokens": 256}},
    ],
}


def _main(*argv: str) -> tuple[int, str]:
    """``moecompress ARGV`` in this process: the exit code and stderr."""
    progress.configure()
    err, saved, code = io.StringIO(), sys.argv, 0
    sys.argv = ["moecompress", *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    finally:
        sys.argv = saved
        progress.configure()
    return code, err.getvalue()


def _fail_at(monkeypatch, matches, nth: int, code: int = errno.ENOSPC) -> list:
    """Make the first write to the ``nth`` file opened whose path ``matches`` fail with ``code`` (each append is an
    opening of its own); returns the handles opened."""
    real, seen = files.write_chunk, []

    def write_chunk(handle, data):
        if matches(Path(handle.name)) and not any(handle is other for other in seen):
            seen.append(handle)
            if len(seen) == nth:
                raise OSError(code, os.strerror(code))
        real(handle, data)

    monkeypatch.setattr(files, "write_chunk", write_chunk)
    return seen


def _units(run: Path) -> int:
    journal = run / ".step-0.incomplete" / "journal.jsonl"
    return len(journal.read_text().splitlines()) - 1 if journal.is_file() else 0


# Each kind of file a run writes: which file to fail (the nth opened with a matching path), and what the failed run
# must have kept. The sensitivity's own state, the rewriting sweep's and the report the writer writes take the same
# paths as the spill, the measuring sweep's state and the report after the evaluation.
KINDS = {
    "sensitivity spill": (
        lambda p: p.parent.name.startswith("fisher-inputs-"),
        2,
        lambda run: (run / "manifest.json").is_file() and not list(run.rglob("fisher-inputs-*")),
    ),
    "calibration state": (
        lambda p: p.name == "hidden.safetensors.tmp" and p.parent.name == "measure",
        2,
        lambda run: (run / ".step-0.incomplete/state/measure/hidden.safetensors").is_file(),
    ),
    "output shard": (lambda p: p.name.startswith("shard-"), 3, lambda run: _units(run) == 2),
    "journal": (lambda p: p.name == "journal.jsonl", 3, lambda run: _units(run) == 2),
    "run manifest": (lambda p: p.name == "manifest.json.tmp", 2, lambda run: (run / "step-0").is_dir()),
    "report after the evaluation": (
        lambda p: p.name == "moecompress_report.json.tmp",
        3,
        lambda run: (run / "step-0" / "moecompress_report.json").is_file(),
    ),
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    code, err = _main("run", str(recipe), "--out", str(root / "out"), "--quiet")
    assert code == 0, err
    return recipe, tree_hashes(root / "out")


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_full_disk_in_each_kind_of_file_keeps_the_work_and_resume_finishes(kind, uninterrupted, tmp_path):
    recipe, reference = uninterrupted
    matches, nth, kept = KINDS[kind]
    out = tmp_path / "out"
    argv = ("run", str(recipe), "--out", str(out), "--quiet")
    with pytest.MonkeyPatch.context() as patch:
        seen = _fail_at(patch, matches, nth)
        code, err = _main(*argv)
    assert len(seen) == nth, f"the run opened {len(seen)} such files, the fault was for file {nth}"
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"moecompress: error: no space left on the device writing {out}"), lines[0]
    assert f"run `moecompress {' '.join(argv)} --resume` to continue" in lines[0], lines[0]
    run = tmp_path / ".out.run"
    assert not out.exists() and run.is_dir() and kept(run), sorted(p.name for p in run.rglob("*"))
    assert not list(tmp_path.rglob("*.tmp")), "a failed atomic write removes its temporary file"
    code, err = _main(*argv, "--resume")
    assert code == 0, err
    assert not run.exists()
    assert tree_hashes(out) == reference


def test_a_quota_and_a_size_limit_are_named(tmp_path, monkeypatch):
    for code, reason in ((errno.EDQUOT, "disk quota exceeded"), (errno.EFBIG, "file-size limit reached")):
        out = tmp_path / f"out-{code}"
        _fail_at(monkeypatch, lambda p: p.name.startswith("shard-"), 1, code)
        argv = ("--out", str(out), "--calib-tokens", "256", "--seq-len", "64", "--no-eval", "--quiet")
        exit_code, err = _main("prune", "builtin:tiny-moe", *argv)
        assert exit_code == 2 and err.count("\n") == 1, err
        assert f"{reason} writing {out}" in err and "--resume` to continue" in err, err


def test_a_command_without_resume_says_nothing_of_it_and_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "eval.json"
    _fail_at(monkeypatch, lambda p: p.name == "eval.json.tmp", 1)
    code, err = _main("eval", "builtin:tiny-moe", "--eval-tokens", "128", "--seq-len", "64", "--json-out", str(target))
    assert code == 2, err
    assert err.startswith(f"moecompress: error: no space left on the device writing {target} (at least ")
    assert err.count("\n") == 1 and "--resume" not in err, err
    assert list(tmp_path.iterdir()) == []


def test_an_atomic_write_says_how_much_more_it_needed_and_leaves_no_temporary(tmp_path, monkeypatch):
    real = files.write_chunk
    calls = []

    def half_then_full(handle, data):
        calls.append(len(data))
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(handle, data)

    monkeypatch.setattr(files, "write_chunk", half_then_full)
    import torch

    tensors = {"a": torch.zeros(1024), "b": torch.zeros(2048)}
    with pytest.raises(files.DiskFullError, match=r"writing .*state.safetensors \(at least 12.0 KiB more needed\)"):
        files.write_safetensors(tmp_path / "state.safetensors", tensors, {})
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_filesystem(tmp_path):
    """A 1 MiB tmpfs mounted for the test (needs root; skipped where mounting is not allowed)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=False)


def test_a_really_full_disk_keeps_the_work_and_resume_gives_the_same_bytes(small_filesystem, tmp_path):
    argv = ["quantize", "builtin:tiny-moe", "--scheme", "mxfp4", "--no-eval", "--quiet"]
    reference = tmp_path / "reference"
    assert run_cli(*argv, "--out", str(reference)).returncode == 0
    out = small_filesystem / "quantized"
    result = run_cli(*argv, "--out", str(out))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"no space left on the device writing {out}" in lines[0], result.stderr
    assert "make room and run `moecompress " in lines[0] and "--resume` to continue" in lines[0], lines[0]
    assert not out.exists() and (small_filesystem / ".quantized.run").is_dir()
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_filesystem)], check=True)
    resumed = run_cli(*argv, "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert tree_hashes(out) == tree_hashes(reference)
    assert [p.name for p in small_filesystem.iterdir()] == ["quantized"]


def test_a_file_size_limit_is_one_line_not_a_killed_process(tmp_path):
    """With ``ulimit -f`` below the output's size the kernel sends SIGXFSZ; the CLI ignores it (here even where the
    host restored its default action, which ends the process), so the write fails with EFBIG, reported like a full
    disk, and --resume without the limit finishes with the same bytes."""
    entry = "import signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_DFL); sys.argv[0] = 'moecompress'; "
    entry += "from moecompress.cli.main import main; main()"
    argv = [sys.executable, "-c", entry, "prune", "builtin:tiny-moe", "--calib-tokens", "256"]
    argv += ["--seq-len", "64", "--no-eval", "--quiet"]
    limit = 1 << 20

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    failed = subprocess.run([*argv, "--out", str(out)], capture_output=True, text=True, env=env, preexec_fn=limited)
    assert failed.returncode == 2, (failed.returncode, failed.stderr)
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and f"file-size limit reached writing {out}" in lines[0], failed.stderr
    resumed = subprocess.run([*argv, "--out", str(out), "--resume"], capture_output=True, text=True, env=env)
    assert resumed.returncode == 0, resumed.stderr
    reference = tmp_path / "reference"
    fresh = subprocess.run([*argv, "--out", str(reference)], capture_output=True, text=True, env=env)
    assert fresh.returncode == 0, fresh.stderr
    assert tree_hashes(out) == tree_hashes(reference)


def test_the_command_that_continues_is_the_same_one_with_resume():
    from moecompress.cli.interrupts import resume_hint
    from moecompress.cli.main import app

    hint = resume_hint(app, ["--debug", "prune", "m dir", "--out", "o", "--restart"], "make room and ")
    command = "moecompress --debug prune 'm dir' --out o --resume"
    assert hint == f"; the partial work is kept: make room and run `{command}` to continue"
    assert resume_hint(app, ["run", "r.yaml", "--out", "o", "--resume"]).count("--resume") == 1
    assert resume_hint(app, ["eval", "m", "--json-out", "x.json"]) == ""
    assert resume_hint(app, ["bench", "kernels"]) == ""
