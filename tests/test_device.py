"""--device: parsing and refusal, recipes' device:, and device discipline (every tensor the passes create is placed
explicitly: with torch's default device set to meta, a ``device="cpu"`` run writes the same bytes as a normal run)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moecompress
from moecompress.device import compute_device, parse_device, using_device
from moecompress.errors import UserInputError
from moecompress.recipes import parse_recipe

CALIBRATION = {"tokens": 512, "seq_len": 64}
EVALUATION = {"tokens": 256}


def test_parse_device() -> None:
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device(None) == parse_device("auto")
    assert parse_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("gpu", "cuda:x", "cpu:0", "tpu", ""):
        with pytest.raises(UserInputError, match="is not a device"):
            parse_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA")
def test_cuda_refused_without_cuda() -> None:
    with pytest.raises(UserInputError, match="no CUDA device"):
        parse_device("cuda:0")
    with pytest.raises(UserInputError, match="device: 'cuda'"):
        parse_recipe({"model": "builtin:tiny-moe", "device": "cuda", "passes": [{"quantize": {}}]})


@pytest.mark.parametrize("command", ["prune", "quantize", "eval", "qat", "prune-heads"])
def test_bad_device_is_one_line_exit_2(command: str, tmp_path: Path) -> None:
    args = [command, "builtin:tiny-moe", "--device", "gpu"]
    if command != "eval":
        args += ["--out", str(tmp_path / "out")]
    done = subprocess.run(
        [sys.executable, "-m", "moecompress.cli.main", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "moecompress: error: --device: 'gpu' is not a device; use auto|cpu|cuda|cuda:N"
    ]
    assert not (tmp_path / "out").exists()


def test_recipe_device_key() -> None:
    recipe = parse_recipe({"model": "builtin:tiny-moe", "device": "cpu", "passes": [{"quantize": {}}]})
    assert recipe.device == "cpu"
    with pytest.raises(UserInputError, match="not a device"):
        parse_recipe({"model": "builtin:tiny-moe", "device": "npu", "passes": [{"quantize": {}}]})


def test_using_device_restores() -> None:
    with using_device("cpu") as device:
        assert compute_device() == device == torch.device("cpu")
    assert compute_device() == torch.device("cpu")


def _hashes(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if path.suffix == ".safetensors" or path.name == "config.json"
    }


def _work(root: Path) -> dict:
    pruned = moecompress.prune(
        "builtin:tiny-moe",
        root / "pruned",
        method="maep",
        scope="global",
        ratio=0.25,
        calibration=CALIBRATION,
        evaluation=EVALUATION,
        device="cpu",
    )
    quantized = moecompress.quantize(
        "builtin:tiny-moe",
        root / "quantized",
        scheme="int2",
        method="gptq",
        salient_fraction=0.01,
        lowrank_budget=0.375,
        sensitivity="fisher-token",
        calibration=CALIBRATION,
        evaluation=None,
        device="cpu",
    )
    figures = moecompress.evaluate(root / "quantized", "builtin:tiny-moe", seq_len=64, max_tokens=256, device="cpu")
    return {
        "pruned": _hashes(pruned.out),
        "pruned_eval": pruned.evaluation,
        "kept": pruned.kept,
        "quantized": _hashes(quantized.out),
        "eval": (figures.perplexity, figures.kl, figures.reference_perplexity, figures.routing_agreement),
    }


def test_meta_default_device_changes_nothing(tmp_path: Path) -> None:
    """Any tensor created without an explicit device would land on meta and fail (or differ) here."""
    normal = _work(tmp_path / "normal")
    torch.set_default_device("meta")
    try:
        on_meta_default = _work(tmp_path / "meta")
    finally:
        torch.set_default_device(None)
    for key in ("pruned", "quantized", "kept"):
        assert on_meta_default[key] == normal[key], key
    assert on_meta_default["eval"] == normal["eval"]
    for name in ("perplexity", "kl", "reference_perplexity", "routing_agreement"):
        assert getattr(on_meta_default["pruned_eval"], name) == getattr(normal["pruned_eval"], name), name


def test_accelerated_sweep_path_on_cpu(tmp_path: Path, monkeypatch) -> None:
    """The sweep's accelerator path (prefetch thread, call arguments kept per device, outputs kept on the host) run
    on the CPU: the same bytes as the plain path, and layers after the first were read by the prefetch thread."""
    import threading

    from moecompress import sweep

    options = dict(method="maep", ratio=0.25, calibration=CALIBRATION, evaluation=None, device="cpu")
    plain = moecompress.prune("builtin:tiny-moe", tmp_path / "plain", **options)
    readers: list[str] = []
    original = sweep.CalibrationSweep._read_layer

    def spy(self, layer):
        readers.append(threading.current_thread().name)
        return original(self, layer)

    monkeypatch.setattr(sweep, "is_accelerated", lambda: True)
    monkeypatch.setattr(sweep.CalibrationSweep, "_read_layer", spy)
    accelerated = moecompress.prune("builtin:tiny-moe", tmp_path / "accelerated", **options)
    assert _hashes(accelerated.out) == _hashes(plain.out)
    assert sum(name.startswith("moecompress-prefetch") for name in readers) >= 3


def test_whole_model_evaluation_under_meta_default() -> None:
    """The whole-model evaluation (the fallback for exports the streamed one does not build) loads its models on an
    explicit device: under a meta default device it gives the same figures."""
    from moecompress.checkpoint import resolve_model
    from moecompress.evals.perplexity import evaluate

    model = resolve_model("builtin:tiny-moe")
    options = dict(seq_len=64, max_tokens=256, reference_dir=model, whole_model=True, progress=False)
    normal = evaluate(model, "builtin:prose", **options)
    torch.set_default_device("meta")
    try:
        with using_device("cpu"):
            on_meta_default = evaluate(model, "builtin:prose", **options)
    finally:
        torch.set_default_device(None)
    assert (on_meta_default.perplexity, on_meta_default.kl) == (normal.perplexity, normal.kl)
