"""Thread counts: prune with unweighted MAEP, RTN and GPTQ write the same bytes with 1 and 2 threads (the report
records the count). MAEP's default Fisher token weights come from a backward pass whose float sums depend on the
thread count, so its scores differ in their last bits: the experts kept (here) and the tensors do not. The default
recipe's bytes do differ, so a run records its count and a resume with another count is refused before any work,
the partial work kept, and the resume with the recorded count finishes it."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import tree_hashes

TINY = ["builtin:tiny-moe", "--no-eval", "--quiet"]
CALIBRATED = [*TINY, "--calib-tokens", "256", "--seq-len", "64"]
COMMANDS = {
    "prune": ["prune", *CALIBRATED, "--method", "maep", "--ratio", "0.25", "--token-weight", "none"],
    "quantize-rtn": ["quantize", *TINY, "--scheme", "int4"],
    "quantize-gptq": ["quantize", *CALIBRATED, "--scheme", "int4", "--method", "gptq"],
}
RECIPE = {
    "model": "builtin:tiny-moe",
    "calibration": {"source": "builtin:prose", "tokens": 256, "seq_len": 64, "seed": 0},
    "passes": [
        {"prune_experts": {"method": "maep", "ratio": 0.25, "scope": "layer"}},
        {"quantize": {"scheme": "mxfp4"}},
        {"lowrank": {"lowrank_budget": 0.375}},
        {"eval": {"data": "builtin:prose", "tokens": 256}},
    ],
}


def _start(args: list[str], threads: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "moecompress.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )


def _finish(process: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.parametrize("command", COMMANDS)
def test_one_and_two_threads_write_the_same_bytes(command, tmp_path):
    outs = {threads: tmp_path / f"threads-{threads}" for threads in (1, 2)}
    processes = {threads: _start([*COMMANDS[command], "--out", str(out)], threads) for threads, out in outs.items()}
    for process in processes.values():
        result = _finish(process)
        assert result.returncode == 0, result.stderr
    hashes = {threads: tree_hashes(out) for threads, out in outs.items()}
    reports = {threads: json.loads((out / "moecompress_report.json").read_text()) for threads, out in outs.items()}
    assert [reports[threads].pop("threads") for threads in (1, 2)] == [1, 2]
    assert reports[1] == reports[2]
    assert hashes[1].pop("moecompress_report.json") != hashes[2].pop("moecompress_report.json")
    assert hashes[1] == hashes[2]


def test_fisher_weighted_prune_keeps_the_same_experts_and_tensors_with_one_and_two_threads(tmp_path):
    command = ["prune", *CALIBRATED, "--method", "maep", "--ratio", "0.25"]
    outs = {threads: tmp_path / f"threads-{threads}" for threads in (1, 2)}
    processes = {threads: _start([*command, "--out", str(out)], threads) for threads, out in outs.items()}
    for process in processes.values():
        result = _finish(process)
        assert result.returncode == 0, result.stderr
    reports = {threads: json.loads((out / "moecompress_report.json").read_text()) for threads, out in outs.items()}
    kept = {threads: {k: v["kept"] for k, v in report["layers"].items()} for threads, report in reports.items()}
    assert kept[1] == kept[2]
    for layer, entry in reports[1]["layers"].items():
        assert entry["score"] == pytest.approx(reports[2]["layers"][layer]["score"], rel=1e-4, abs=1e-12)
    hashes = {threads: tree_hashes(out) for threads, out in outs.items()}
    for files in hashes.values():
        files.pop("moecompress_report.json")
    assert hashes[1] == hashes[2]


def _all_files(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def _journal_units(run: Path) -> int:
    journal = run / ".step-0.incomplete" / "journal.jsonl"
    return len(journal.read_text().splitlines()) - 1 if journal.is_file() else 0


def test_a_resume_with_another_thread_count_is_refused_and_the_recorded_count_finishes_it(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    out = tmp_path / "out"
    run = tmp_path / ".out.run"
    args = ["run", str(recipe), "--out", str(out), "--quiet"]

    killed = _start(args, threads=1)
    deadline = time.monotonic() + 240
    while _journal_units(run) < 1:
        assert killed.poll() is None, "the run finished before a layer was written: " + killed.stderr.read()
        assert time.monotonic() < deadline, "no layer was written in time"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert json.loads((run / "manifest.json").read_text())["threads"] == 1
    partial = _all_files(run)

    refused = _finish(_start([*args, "--resume"], threads=2))
    assert refused.returncode == 2 and refused.stdout == ""
    assert len(refused.stderr.splitlines()) == 1, refused.stderr
    assert "thread count was 1 and this one's is 2" in refused.stderr and "OMP_NUM_THREADS=1" in refused.stderr
    assert _all_files(run) == partial, "the refused resume must keep the partial work as it was"
    assert not out.exists()

    resumed = _finish(_start([*args, "--resume"], threads=1))
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((out / "moecompress_report.json").read_text())["threads"] == 1


def test_the_cli_makes_idle_openmp_threads_sleep_unless_the_user_chose():
    """libgomp reads OMP_WAIT_POLICY when torch loads: the CLI package sets it first (BENCHMARKS.md, "Threads")."""
    probe = "import os, sys, moecompress.cli; print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'))"
    for chosen, seen in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
        if chosen is not None:
            env["OMP_WAIT_POLICY"] = chosen
        result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["False", seen]
