"""Resume: a recipe run killed (SIGKILL, SIGTERM, SIGINT) at several points and resumed each time writes exactly the
bytes of an uninterrupted run; SIGTERM and SIGINT end in one line giving the command that continues (exit code 128 +
the signal); the writer's journal and the sweep states survive a kill and are checked on reopening.

The recipe (prune + GPTQ + low-rank + eval) runs as one layer pipeline: the kill points are its sensitivity, its
measuring sweep, its rewriting sweep, its written layers and the evaluation."""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from helpers import CLI_COMMITTING_EVERY_LAYER, tree_hashes

from moecompress.checkpoint import CheckpointWriter
from moecompress.sweep.state import SweepState

RECIPE = {
    "model": "builtin:tiny-moe",
    "calibration": {"source": "builtin:prose", "tokens": 1024, "seq_len": 128, "seed": 3},
    "passes": [
        {"prune_experts": {"method": "maep", "ratio": 0.25}},
        {"quantize": {"scheme": "int4", "method": "gptq"}},
        {"lowrank": {"lowrank_budget": 0.5, "sensitivity": "fisher-token"}},
        {"eval": {"data": "builtin:prose", "tokens": 1024}},
    ],
}


def _start(recipe: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*CLI_COMMITTING_EVERY_LAYER, "run", str(recipe), "--out", str(out), "--quiet", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _kill_when(process: subprocess.Popen, condition, signum=signal.SIGKILL, timeout: float = 240.0) -> bool:
    """Send ``signum`` to ``process`` as soon as ``condition()`` holds; False when it finished first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if condition():
            process.send_signal(signum)
            process.wait(timeout=120)
            return True
        time.sleep(0.02)
    process.kill()
    raise AssertionError("the run neither reached the kill point nor finished")


def _journal_units(work: Path) -> int:
    journal = work / "journal.jsonl"
    return len(journal.read_text().splitlines()) - 1 if journal.is_file() else 0


def test_killed_at_several_points_and_resumed_gives_the_same_bytes(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    out = tmp_path / "runs" / "out"
    uninterrupted = _start(recipe, out)
    assert uninterrupted.wait() == 0, uninterrupted.stderr.read()
    reference = tmp_path / "reference"
    out.rename(reference)

    run = out.parent / ".out.run"
    work = run / ".step-0.incomplete"
    points = [
        ("sensitivity computed", lambda: (work / "state/sensitivity.safetensors").exists(), signal.SIGKILL),
        ("measuring sweep", lambda: (work / "state/measure/hidden.safetensors").exists(), signal.SIGTERM),
        ("rewriting sweep", lambda: (work / "state/rewrite/hidden.safetensors").exists(), signal.SIGINT),
        ("layers written", lambda: _journal_units(work) >= 3, signal.SIGTERM),
        ("evaluation", lambda: (run / "step-0").is_dir(), signal.SIGINT),
    ]
    continues = f"the partial work is kept: run `moecompress run {recipe} --out {out} --quiet --resume` to continue"
    killed = []
    for index, (name, condition, signum) in enumerate(points):
        process = _start(recipe, out, *(["--resume"] if index else []))
        if _kill_when(process, condition, signum):
            killed.append(name)
            assert not out.exists(), f"killed during {name}, the output must not exist yet"
            if signum != signal.SIGKILL:
                assert process.returncode == 128 + signum, (name, process.returncode, process.stderr.read())
                line = f"moecompress: interrupted by {signal.Signals(signum).name}; {continues}"
                assert process.stderr.read().strip().splitlines() == [line], name
        else:
            assert process.returncode == 0, process.stderr.read()
            shutil.rmtree(out)
            pytest.fail(f"the run finished before the kill point {name!r}")
    assert killed == [name for name, *_ in points]
    final = _start(recipe, out, "--resume")
    assert final.wait() == 0, final.stderr.read()
    assert not run.exists()
    assert tree_hashes(out) == tree_hashes(reference)


def test_the_writer_keeps_intact_units_and_drops_a_damaged_one(tmp_path):
    out = tmp_path / "out"
    tensors = [{f"t{i}.{j}": torch.full((5 + j,), float(i)) for j in range(3)} for i in range(4)]
    writer = CheckpointWriter(out, max_shard_bytes=64)
    for i, unit in enumerate(tensors[:3]):
        writer.add(unit, unit=f"u{i}", meta={"i": i})
    last_data = sorted(writer.work_dir.glob("shard-*.data"))[-1]
    damaged = bytearray(last_data.read_bytes())
    damaged[-1] ^= 0xFF
    last_data.write_bytes(bytes(damaged))
    resumed = CheckpointWriter(out, max_shard_bytes=64, resume=True)
    assert list(resumed.units) == ["u0", "u1"] and resumed.units["u1"].meta == {"i": 1}
    with pytest.raises(ValueError, match="written twice"):
        resumed.add(tensors[0], unit="u0")
    for i in (2, 3):
        resumed.add(tensors[i], unit=f"u{i}")
    resumed.finish({"model_type": "x"})
    fresh = tmp_path / "fresh"
    writer = CheckpointWriter(fresh, max_shard_bytes=64)
    for i, unit in enumerate(tensors):
        writer.add(unit, unit=f"u{i}")
    writer.finish({"model_type": "x"})
    assert tree_hashes(out) == tree_hashes(fresh)
    assert not (tmp_path / ".out.incomplete").exists()


def test_a_fresh_writer_ignores_an_old_journal(tmp_path):
    writer = CheckpointWriter(tmp_path / "out")
    writer.add({"a": torch.ones(3)}, unit="u0")
    assert CheckpointWriter(tmp_path / "out").units == {}
    assert list(CheckpointWriter(tmp_path / "out", resume=True).units) == []


def test_a_sweep_state_resumes_after_its_last_commit(tmp_path):
    state = SweepState(tmp_path / "s")
    hidden = [torch.randn(2, 3), torch.randn(1, 3)]
    state.commit(0, hidden, ({"score": torch.arange(4.0)}, {"layer": 0}))
    state.commit(1, [h + 1 for h in hidden], None)
    again = SweepState(tmp_path / "s")
    assert again.start_layer == 2
    assert all(torch.equal(a, b + 1) for a, b in zip(again.hidden(), hidden, strict=True))
    stored_tensors, meta = again.results()[0]
    assert torch.equal(stored_tensors["score"], torch.arange(4.0)) and meta == {"layer": 0}
    (tmp_path / "s" / "hidden.safetensors").write_bytes(b"torn")
    assert SweepState(tmp_path / "s").start_layer == 0


def test_a_sweep_state_commits_when_its_interval_has_passed_and_after_the_last_layer(tmp_path, monkeypatch):
    import moecompress.sweep.state as sweep_state

    monkeypatch.setattr(sweep_state, "COMMIT_INTERVAL_S", 3600.0)
    state = SweepState(tmp_path / "s")
    hidden = [torch.randn(2, 3)]
    state.commit(0, hidden, ({"score": torch.zeros(2)}, {"layer": 0}), last=False)
    state.commit(1, [h + 1 for h in hidden], ({"score": torch.ones(2)}, {"layer": 1}), last=False)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == []
    assert SweepState(tmp_path / "s").start_layer == 0
    monkeypatch.setattr(sweep_state, "COMMIT_INTERVAL_S", 0.0)
    state.commit(2, [h + 2 for h in hidden], None, last=False)
    again = SweepState(tmp_path / "s")
    assert again.start_layer == 3 and torch.equal(again.hidden()[0], hidden[0] + 2)
    assert {layer: meta for layer, (_, meta) in again.results().items()} == {0: {"layer": 0}, 1: {"layer": 1}}
    monkeypatch.setattr(sweep_state, "COMMIT_INTERVAL_S", 3600.0)
    state.commit(3, [h + 3 for h in hidden], None, last=True)
    assert SweepState(tmp_path / "s").start_layer == 4


def test_a_sweep_state_keeps_one_result_stored_under_two_names(tmp_path):
    score = torch.arange(4.0)
    SweepState(tmp_path / "s").commit(0, [torch.zeros(1, 2)], ({"score": score, "reap": score}, {}))
    stored_tensors, _ = SweepState(tmp_path / "s").results()[0]
    assert torch.equal(stored_tensors["score"], score) and torch.equal(stored_tensors["reap"], score)


def _write_units(out: Path, units: list[dict[str, torch.Tensor]], max_shard_bytes: int) -> Path:
    writer = CheckpointWriter(out, max_shard_bytes=max_shard_bytes)
    for i, unit in enumerate(units):
        writer.add(unit, unit=f"u{i}")
    return writer.finish({"model_type": "x"})


def _mixed_units() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            f"layers.{i}.w": torch.randn(300 + 7 * i, generator=generator).to(torch.bfloat16),
            f"layers.{i}.codes": torch.randint(0, 255, (1001 + i,), dtype=torch.uint8, generator=generator),
            f"layers.{i}.scale": torch.randn(3, 5, generator=generator),
        }
        for i in range(5)
    ]


def test_shards_load_with_safetensors_and_their_data_starts_on_a_page(tmp_path):
    from safetensors import safe_open

    units = _mixed_units()
    out = _write_units(tmp_path / "out", units, max_shard_bytes=3000)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 2
    loaded = {}
    for shard in shards:
        with open(shard, "rb") as handle:
            assert (8 + int.from_bytes(handle.read(8), "little")) % 4096 == 0
        with safe_open(shard, "pt") as handle:
            loaded.update({key: handle.get_tensor(key) for key in handle.keys()})
    expected = {key: tensor for unit in units for key, tensor in unit.items()}
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[key], expected[key]) for key in expected)


def test_the_header_is_inserted_in_place_or_copied_to_the_same_bytes(tmp_path, monkeypatch):
    from moecompress.checkpoint import writer as writer_module

    inserted = []
    real_insert = writer_module._insert_in_front

    def recording_insert(path, prefix):
        inserted.append(real_insert(path, prefix))
        return inserted[-1]

    monkeypatch.setattr(writer_module, "_insert_in_front", recording_insert)
    in_place = _write_units(tmp_path / "a", _mixed_units(), max_shard_bytes=3000)
    monkeypatch.setattr(writer_module, "_insert_in_front", lambda path, prefix: False)
    copied = _write_units(tmp_path / "b", _mixed_units(), max_shard_bytes=3000)
    assert tree_hashes(in_place) == tree_hashes(copied)
    if not any(inserted):
        pytest.skip("this filesystem has no FALLOC_FL_INSERT_RANGE; only the copy path ran")


def test_a_resumed_writer_cuts_off_bytes_no_journal_line_names(tmp_path):
    units = _mixed_units()
    writer = CheckpointWriter(tmp_path / "out", max_shard_bytes=3000)
    for i, unit in enumerate(units[:3]):
        writer.add(unit, unit=f"u{i}")
    last_data = sorted(writer.work_dir.glob("shard-*.data"))[-1]
    with open(last_data, "ab") as handle:
        handle.write(b"half a unit, written before the kill")
    resumed = CheckpointWriter(tmp_path / "out", max_shard_bytes=3000, resume=True)
    assert list(resumed.units) == ["u0", "u1", "u2"]
    for i, unit in enumerate(units[3:], start=3):
        resumed.add(unit, unit=f"u{i}")
    resumed.finish({"model_type": "x"})
    assert tree_hashes(tmp_path / "out") == tree_hashes(_write_units(tmp_path / "fresh", units, 3000))


def test_a_shard_a_killed_finish_already_renamed_is_redone(tmp_path):
    """``finish`` turns each shard's data file into its safetensors file in turn; a kill in between leaves the
    first data file gone. The resumed writer keeps no unit whose bytes it cannot find and redoes them."""
    units = _mixed_units()
    writer = CheckpointWriter(tmp_path / "out", max_shard_bytes=3000)
    for i, unit in enumerate(units):
        writer.add(unit, unit=f"u{i}")
    first_data = sorted(writer.work_dir.glob("shard-*.data"))[0]
    os.replace(first_data, writer.work_dir / "model-00001-of-00009.safetensors")
    resumed = CheckpointWriter(tmp_path / "out", max_shard_bytes=3000, resume=True)
    assert list(resumed.units) == []
    assert not list(resumed.work_dir.glob("*.safetensors")) and not list(resumed.work_dir.glob("shard-*.data"))
    for i, unit in enumerate(units):
        resumed.add(unit, unit=f"u{i}")
    resumed.finish({"model_type": "x"})
    assert tree_hashes(tmp_path / "out") == tree_hashes(_write_units(tmp_path / "fresh", units, 3000))
