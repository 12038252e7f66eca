"""Expert merging (``--method merge``) and router recalibration (``--recalibrate-router``) through the pruning pass:
the written checkpoint holds what the definitions compute, loads in stock transformers, exports like a pruned one,
and a killed run resumes to the same bytes."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import CLI_COMMITTING_EVERY_LAYER, load_stock, run_cli, tree_hashes

import moecompress
from moecompress.calibration.model_inputs import calibration_batches
from moecompress.checkpoint import CheckpointReader
from moecompress.errors import UserInputError
from moecompress.export.llama_cpp import ENV_VAR, find_converter
from moecompress.families import adapter_for
from moecompress.passes.expert_merge import merge_experts
from moecompress.passes.prune_experts import PruneExpertsConfig, prune_experts
from moecompress.sweep.engine import CalibrationSweep

TINY = Path(moecompress.__file__).parent / "assets" / "tiny-moe"
CALIB = dict(calib="builtin:prose", calib_tokens=1024, seq_len=128)


def _converter():
    try:
        return find_converter(None)
    except UserInputError:
        return None


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    out = tmp_path_factory.mktemp("merge") / "out"
    report = prune_experts(TINY, out, PruneExpertsConfig(method="merge", ratio=0.25), **CALIB, progress=False)
    return out, report


def _layer_zero_capture():
    """Layer 0's rewriting-sweep capture: its inputs are the embeddings, the same whatever later layers become."""
    adapter = adapter_for(json.loads((TINY / "config.json").read_text()))
    batches, tags, names = calibration_batches(
        adapter, TINY, CALIB["calib"], CALIB["calib_tokens"], CALIB["seq_len"], 8, 0, 224
    )
    sweep = CalibrationSweep(TINY, batches, tags, names, keep_tensors=True, progress=False)
    capture = next(iter(sweep.run()))
    return adapter, capture


def _written_block(out: Path, layer: int):
    adapter = adapter_for(json.loads((out / "config.json").read_text()))
    with CheckpointReader(out) as reader:
        layers = {}
        for key in reader.keys():
            if adapter.layer_of_key(key) == layer:
                layers[key] = key
        moe, _, _ = adapter.split_layer(layer, reader.read(list(layers)))
    return moe


def test_merged_layer_is_its_definition_and_loads_in_stock_transformers(merged):
    out, report = merged
    config = json.loads((out / "config.json").read_text())
    assert config["num_local_experts"] == 6 and config["num_experts_per_tok"] == 2
    groups = report["layers"]["0"]["merged"]
    assert sorted(e for group in groups for e in group) == list(range(8)) and len(groups) == 6
    adapter, capture = _layer_zero_capture()
    positions = [[capture.moe.expert_ids.index(e) for e in group] for group in groups]
    expected, _ = merge_experts(adapter, capture.moe, positions, capture.moe_input, router_input=capture.router_input)
    written = _written_block(out, 0)
    assert written.expert_ids == [group[0] for group in groups]
    for name in ("gate_up", "down", "router_weight"):
        assert torch.equal(getattr(written, name), getattr(expected, name).to(torch.bfloat16)), name
    for position, group in enumerate(groups):
        if len(group) == 1:
            assert torch.equal(written.gate_up[position], capture.moe.gate_up[group[0]])
    model = load_stock(out)
    ids = torch.randint(0, 2048, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_router_refit_lowers_every_layers_error_and_loads_in_stock_transformers(tmp_path):
    out = tmp_path / "recal"
    config = PruneExpertsConfig(method="maep", ratio=0.25, recalibrate_router=True)
    report = prune_experts(TINY, out, config, **CALIB, progress=False)
    plain = prune_experts(
        TINY, tmp_path / "plain", PruneExpertsConfig(method="maep", ratio=0.25), **CALIB, progress=False
    )
    for layer, entry in report["layers"].items():
        refit = entry["router_refit"]
        assert refit["error_after"] <= refit["error_before"], layer
        assert entry["kept"] == plain["layers"][layer]["kept"]
    assert any(
        entry["router_refit"]["error_after"] < entry["router_refit"]["error_before"]
        for entry in report["layers"].values()
    )
    written, selected = _written_block(out, 0), _written_block(tmp_path / "plain", 0)
    assert torch.equal(written.gate_up, selected.gate_up) and torch.equal(written.down, selected.down)
    assert not torch.equal(written.router_weight, selected.router_weight)
    model = load_stock(out)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.arange(32)[None]).logits).all()


def test_merge_refuses_several_ranks_in_one_line(monkeypatch, tmp_path):
    from moecompress.calibration import distributed

    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "init_from_environment", lambda: None)
    with pytest.raises(UserInputError, match="single process"):
        prune_experts(TINY, tmp_path / "x", PruneExpertsConfig(method="merge", ratio=0.25), **CALIB, progress=False)


def test_merged_output_exports_to_compressed_tensors_and_loads(merged, tmp_path):
    out, _ = merged
    target = tmp_path / "ct"
    result = run_cli(
        "quantize",
        str(out),
        "--out",
        str(target),
        "--scheme",
        "int4",
        "--format",
        "compressed-tensors",
        "--no-eval",
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    config = json.loads((target / "config.json").read_text())
    assert config["num_local_experts"] == 6 and config["quantization_config"]["quant_method"] == "compressed-tensors"


@pytest.mark.skipif(_converter() is None, reason=f"{ENV_VAR} names no llama.cpp converter")
def test_merged_output_exports_to_gguf(merged, tmp_path):
    import gguf

    out, _ = merged
    target = tmp_path / "merged.gguf"
    result = run_cli("export", str(out), "--format", "gguf", "--out", str(target))
    assert result.returncode == 0, result.stderr
    reader = gguf.GGUFReader(target)
    counts = [int(field.parts[-1][0]) for name, field in reader.fields.items() if name.endswith(".expert_count")]
    assert counts == [6]
    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    assert shapes["blk.0.ffn_down_exps.weight"][-1] == 6
    built = os.environ.get("MOECOMPRESS_LLAMA_CPP_BIN")
    if not built or not (Path(built) / "llama-perplexity").is_file():
        return
    from moecompress.calibration.builtin_corpus import builtin_documents

    text = tmp_path / "heldout.txt"
    text.write_text("\n\n".join(doc.text for doc in builtin_documents("prose", "heldout"))[:20000])
    run = subprocess.run(
        [
            str(Path(built) / "llama-perplexity"),
            "-m",
            str(target),
            "-f",
            str(text),
            "-c",
            "128",
            "--chunks",
            "4",
            "-t",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    estimate = float((run.stdout + run.stderr).split("Final estimate: PPL = ")[1].split()[0])
    assert 1 < estimate < 2048


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [*CLI_COMMITTING_EVERY_LAYER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _kill_when(process: subprocess.Popen, condition, timeout: float = 240.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        if condition():
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=120)
            return True
        time.sleep(0.02)
    process.kill()
    raise AssertionError("the run neither reached the kill point nor finished")


def test_a_killed_merge_with_router_refit_resumes_to_the_same_bytes(tmp_path):
    out = tmp_path / "runs" / "out"
    args = [
        "prune",
        str(TINY),
        "--out",
        str(out),
        "--method",
        "merge",
        "--recalibrate-router",
        "--calib-tokens",
        "1024",
        "--seq-len",
        "128",
        "--no-eval",
        "--quiet",
    ]
    uninterrupted = _start(args)
    assert uninterrupted.wait() == 0, uninterrupted.stderr.read()
    reference = tmp_path / "reference"
    out.rename(reference)
    work = out.parent / ".out.run" / ".step-0.incomplete"
    journal = work / "journal.jsonl"
    points = [
        ("measuring sweep", lambda: (work / "state/measure/hidden.safetensors").exists()),
        ("layers written", lambda: journal.is_file() and len(journal.read_text().splitlines()) >= 3),
    ]
    for index, (name, condition) in enumerate(points):
        process = _start(args + (["--resume"] if index else []))
        assert _kill_when(process, condition), f"the run finished before the kill point {name!r}"
    final = _start([*args, "--resume"])
    assert final.wait() == 0, final.stderr.read()
    assert tree_hashes(out) == tree_hashes(reference)


def test_merging_a_fp8_release_writes_a_plain_checkpoint_stock_transformers_loads(tmp_path):
    from synthetic import save_tiny_source
    from synthetic_quantized import convert_to_block_fp8

    bf16 = save_tiny_source("deepseek_v3", tmp_path / "bf16")
    fp8 = convert_to_block_fp8(bf16, tmp_path / "fp8")
    out = tmp_path / "merged"
    config = PruneExpertsConfig(method="merge", ratio=0.5, recalibrate_router=True)
    report = prune_experts(fp8, out, config, calib_tokens=512, seq_len=64, progress=False)
    written = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in written and "fp8" in report["written_decoded"]
    assert written["n_routed_experts"] == json.loads((fp8 / "config.json").read_text())["n_routed_experts"] // 2
    with CheckpointReader(out, decode=False) as reader:
        assert not [key for key in reader.keys() if key.endswith("weight_scale_inv")]
    model = load_stock(out)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.arange(16)[None]).logits).all()
