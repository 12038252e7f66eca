"""Calibration sharded over torch.distributed ranks gives what one process gives."""

import pytest
import torch

from moecompress.calibration import distributed
from moecompress.errors import UserInputError


def _batches(sizes):
    start, out = 0, []
    for rows in sizes:
        out.append({"input_ids": torch.arange(start, start + rows * 4).reshape(rows, 4)})
        start += rows * 4
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_get_contiguous_whole_batches_with_their_tags(world, monkeypatch):
    batches = _batches([2, 2, 1, 2, 2])
    tags = torch.arange(36) % 5
    monkeypatch.setattr(distributed, "world_size", lambda: world)
    ids, shard_tags = [], []
    for rank in range(world):
        monkeypatch.setattr(distributed, "rank", lambda rank=rank: rank)
        shard = distributed.shard_calibration(batches, tags)
        assert shard.batches, "every rank gets at least one batch"
        assert all(any(b is s for b in batches) for s in shard.batches), "batches are handed out whole"
        ids += [b["input_ids"].reshape(-1) for b in shard.batches]
        shard_tags.append(shard.tags)
    assert torch.equal(torch.cat(ids), torch.arange(36))
    assert torch.equal(torch.cat(shard_tags), tags)


def test_fewer_batches_than_ranks_is_an_error(monkeypatch):
    monkeypatch.setattr(distributed, "world_size", lambda: 3)
    with pytest.raises(UserInputError, match="cannot be shared by 3 ranks"):
        distributed.shard_calibration(_batches([2, 2]), torch.zeros(16, dtype=torch.long))


def test_outside_a_job_reductions_are_the_identity_in_float64():
    a, b = torch.tensor([1.5, 2.0], dtype=torch.float32), torch.ones(2, 3)
    total_a, total_b = distributed.sum_over_ranks(a, b)
    assert total_a.dtype == torch.float64 and torch.equal(total_a, a.double()) and torch.equal(total_b, b.double())
    values, sizes = distributed.gather_in_rank_order(torch.arange(5.0))
    assert torch.equal(values, torch.arange(5.0)) and sizes == [5]
    assert distributed.is_writer() and distributed.world_size() == 1


RANK_SCRIPT = r"""
import json, os, sys, time
from pathlib import Path

root, rank = Path(sys.argv[1]).absolute(), int(os.environ.get("RANK", "0"))
made, real_mkdir = [], os.mkdir


def recording_mkdir(path, *args, **kwargs):
    if Path(path).absolute().is_relative_to(root):
        made.append(str(path))
    return real_mkdir(path, *args, **kwargs)


os.mkdir = recording_mkdir
from moecompress.calibration import distributed
from moecompress.checkpoint import resolve_model
from moecompress.cli.main import app
from moecompress.errors import UserInputError
from moecompress.passes.prune_experts import PruneExpertsConfig, prune_experts

calib = ["--calib-tokens", "3072", "--seq-len", "128", "--no-eval", "-q"]
for index, (name, extra) in enumerate(json.loads(sys.argv[2]).items()):
    if index and rank == 1:
        time.sleep(3)  # rank 0 is already writing this command's partial work when rank 1 checks the output
    app.main(["prune", "builtin:tiny-moe", "--out", str(root / name), *calib, *extra], standalone_mode=False)
report = prune_experts(
    resolve_model("builtin:tiny-moe"),
    root / "tags",
    PruneExpertsConfig(prune_tags=("code",)),
    calib="builtin:prose,builtin:code",
    calib_tokens=3072,
    seq_len=128,
    progress=False,
)
try:
    app.main(["prune", "builtin:tiny-moe", "--out", str(root / "maep"), *calib], standalone_mode=False)
    refused = None
except UserInputError as error:
    refused = str(error)
ranks = distributed.world_size()
(root.parent / f"{root.name}-rank{rank}.json").write_text(
    json.dumps({"ranks": ranks, "made": made, "report": report, "refused": refused})
)
"""

CASES = {"maep": [], "reap": ["--method", "reap"]}
"""3072 calibration tokens in windows of 128 make 3 batches of 1024 tokens: rank 0 gets one, rank 1 two, so the
ranks' token chunks in the expert statistics (2048 tokens) differ from the single process's."""
STATISTICS = ("score", "frequency", "reap", "delta_h")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_ranks(tmp_path, name, ranks):
    import json
    import os
    import subprocess
    import sys

    root = tmp_path / name
    root.mkdir()
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    launcher = []
    if ranks > 1:
        launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1"]
        launcher += ["--master-port", str(_free_port())]
    command = [sys.executable, *launcher, str(script), str(root), json.dumps(CASES)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    errors = "\n".join(line for line in done.stderr.splitlines() if "Error" in line)
    assert done.returncode == 0, done.stdout[-3000:] + errors[-3000:] + done.stderr[-2000:]
    return root, [json.loads((tmp_path / f"{name}-rank{r}.json").read_text()) for r in range(ranks)]


def test_two_gloo_ranks_write_what_one_process_writes(tmp_path):
    """Calibration + pruning over 2 CPU ranks (torchrun, gloo) writes a byte-identical checkpoint and report;
    rank 1 creates nothing and returns rank 0's report; an error on rank 0 (the output exists) reaches both."""
    import json

    from helpers import tree_hashes

    single, (alone,) = _run_ranks(tmp_path, "single", 1)
    shared, (first, second) = _run_ranks(tmp_path, "shared", 2)
    assert alone["ranks"] == 1 and first["ranks"] == second["ranks"] == 2
    for name in (*CASES, "tags"):
        one = json.loads((single / name / "moecompress_report.json").read_text())
        two = json.loads((shared / name / "moecompress_report.json").read_text())
        assert one["layers"].keys() == two["layers"].keys()
        for layer, expected in one["layers"].items():
            for key in STATISTICS:
                assert two["layers"][layer][key] == pytest.approx(expected[key], rel=1e-6, abs=0), (name, layer, key)
            if name == "tags":
                for key in ("preserve_signal", "prune_signal"):
                    got, want = two["layers"][layer]["maep"][key], expected["maep"][key]
                    assert got == pytest.approx(want, rel=1e-6, abs=0), (name, layer, key)
                assert two["layers"][layer]["maep"]["prune_tokens"] == expected["maep"]["prune_tokens"] > 0
        assert tree_hashes(shared / name) == tree_hashes(single / name), f"{name}: the files differ"
    assert first["report"] == second["report"] == alone["report"]
    assert first["made"] and second["made"] == [], "only rank 0 creates directories"
    assert sorted(p.name for p in shared.iterdir()) == sorted(p.name for p in single.iterdir()), "no run dirs left"
    assert "output directory exists" in first["refused"] and first["refused"] == second["refused"]


@pytest.mark.parametrize("passes", [["prune_experts"], ["prune_experts", "quantize"]])
def test_more_than_one_rank_refuses_resume_and_other_passes(passes, monkeypatch, tmp_path):
    from moecompress.passes.prune_experts import PruneExpertsConfig
    from moecompress.passes.quantize import QuantizeConfig
    from moecompress.runner.recipes import Calibration, Recipe, run_recipe

    monkeypatch.setattr(distributed, "init_from_environment", lambda: True)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    configs = {"prune_experts": PruneExpertsConfig(), "quantize": QuantizeConfig()}
    recipe = Recipe("m", Calibration(), passes=[(name, configs[name]) for name in passes])
    expected = "needs a single process, not 2 ranks" if len(passes) == 1 else "can only be one prune_experts pass"
    with pytest.raises(UserInputError, match=expected):
        run_recipe(recipe, tmp_path / "model", tmp_path / "out", resume=len(passes) == 1)
    assert sorted(tmp_path.iterdir()) == [], "nothing is created"
