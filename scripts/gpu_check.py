"""The accelerator check (issue 31): GPU tests, the default recipe on the device against the CPU, per-layer seconds of
prune / int4 GPTQ / low-rank on a 2-layer Qwen3-30B-A3B-shaped checkpoint, and ``moecompress bench kernels``.
Prints one JSON object on stdout (progress on stderr).

``--dry-run`` runs the same steps at tiny sizes on the CPU (the "device" is then the CPU too) and prints the same
keys; tests/test_gpu_check.py runs it so CI exercises the script. Run through scripts/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

LARGE = dict(hidden=2048, experts=128, inter=768, heads=32, kv_heads=4, head_dim=128, top_k=8)
"""Qwen3-30B-A3B's decoder layer (the vocabulary is tiny-moe's, so the built-in calibration text tokenises)."""
TINY = dict(hidden=64, experts=8, inter=32, heads=4, kv_heads=2, head_dim=16, top_k=2)

SIZES = {
    "gpu": dict(calib_tokens=16384, seq_len=256, eval_tokens=16384, shape=LARGE, recipe_calib=None),
    "dry-run": dict(calib_tokens=512, seq_len=64, eval_tokens=256, shape=TINY, recipe_calib=512),
}


def log(message: str) -> None:
    print(f"[gpu_check] {message}", file=sys.stderr, flush=True)


DEADLINE = float("inf")
"""When the whole check must end (``--budget`` seconds after it starts): each child gets what is left at most."""


def python(*args: str, timeout: float) -> subprocess.CompletedProcess:
    timeout = max(1.0, min(timeout, DEADLINE - time.monotonic()))
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=os.environ.copy()
    )


def gpu_tests(timeout: float, work: Path) -> dict[str, Any]:
    """tests/test_gpu.py (every test skips without CUDA); the counts from pytest's JUnit XML."""
    import xml.etree.ElementTree as ElementTree

    started = time.monotonic()
    report = work / "gpu-tests.xml"
    done = python(
        "-m", "pytest", "tests/test_gpu.py", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", timeout=timeout
    )
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if report.exists():
        suite = ElementTree.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {key: int(suite.get(key, 0)) for key in counts}
    failed = counts["failures"] + counts["errors"]
    return {
        "returncode": done.returncode,
        "passed": counts["tests"] - failed - counts["skipped"],
        "failed": failed,
        "skipped": counts["skipped"],
        "seconds": round(time.monotonic() - started, 2),
        "tail": done.stdout.strip().splitlines()[-8:] if done.returncode else [],
    }


def compress(kind: str, device: str, out: str, model: str, options: dict) -> dict[str, Any]:
    """One API call (``run``, ``prune`` or ``quantize``) timed, with its bytes and evaluation figures."""
    import moecompress

    started = time.monotonic()
    if kind == "run":
        result = moecompress.run(options, out=out, model=model, device=device)
    elif kind == "prune":
        result = moecompress.prune(model, out, device=device, **options)
    else:
        result = moecompress.quantize(model, out, device=device, **options)
    seconds = time.monotonic() - started
    evaluation = result.evaluation
    return {
        "seconds": seconds,
        "bytes_after": result.bytes_after,
        "perplexity": None if evaluation is None else evaluation.perplexity,
        "kl": None if evaluation is None else evaluation.kl,
        "routing_agreement": None if evaluation is None else evaluation.routing_agreement,
    }


CHILD = "import json, sys; sys.path.insert(0, 'scripts'); import gpu_check; gpu_check.child()"
IN_PROCESS = False
"""The dry run calls the API in this process (one import of torch instead of one per step); the GPU mode runs each
step in a child process, so that one step's GPU memory and compiled state do not reach the next."""


def child() -> None:
    kind, device, out, model, options = sys.argv[1:6]
    print(json.dumps(compress(kind, device, out, model, json.loads(options))))


def run_child(kind: str, device: str, out: Path, model: str, options: dict, timeout: float) -> dict[str, Any]:
    if IN_PROCESS:
        try:
            return compress(kind, device, str(out), model, options)
        except Exception as error:
            return {"error": f"{type(error).__name__}: {error}"[:400]}
    done = python("-c", CHILD, kind, device, str(out), model, json.dumps(options), timeout=timeout)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["(no output)"])[-1][:400]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def tensor_hashes(directory: Path) -> dict[str, str]:
    import hashlib

    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(directory.glob("*.safetensors"))
    }


def default_recipe(device: str, sizes: dict, work: Path, timeout: float) -> dict[str, Any]:
    """recipes/default.yaml on ``device`` and on the CPU: seconds, bytes, evaluation figures and their differences."""
    import yaml

    recipe = yaml.safe_load((ROOT / "recipes" / "default.yaml").read_text())
    if sizes["recipe_calib"]:
        recipe["calibration"].update(tokens=sizes["recipe_calib"], seq_len=sizes["seq_len"])
        for step in recipe["passes"]:
            if "eval" in step:
                step["eval"]["tokens"] = sizes["eval_tokens"]
    figures = {}
    for name, where in (("cpu", "cpu"), ("device", device)):
        out = work / f"default-{name}"
        figures[name] = run_child("run", where, out, recipe["model"], recipe, timeout)
        figures[name]["tensor_sha256"] = tensor_hashes(out) if out.exists() else {}
    cpu, dev = figures["cpu"], figures["device"]
    compared: dict[str, Any] = {"cpu": _without_hashes(cpu), "device": _without_hashes(dev)}
    if "error" not in cpu and "error" not in dev:
        compared["bytes_identical_to_cpu"] = cpu["tensor_sha256"] == dev["tensor_sha256"]
        compared["perplexity_relative_difference"] = abs(dev["perplexity"] - cpu["perplexity"]) / cpu["perplexity"]
        compared["kl_difference"] = abs(dev["kl"] - cpu["kl"])
        compared["speedup"] = cpu["seconds"] / dev["seconds"] if dev["seconds"] else None
    return compared


def _without_hashes(figures: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in figures.items() if key != "tensor_sha256"}


def large_layers(device: str, sizes: dict, work: Path, timeout: float) -> dict[str, Any]:
    """Prune (MAEP), int4 GPTQ and int4 GPTQ + low-rank on a 2-layer checkpoint of ``sizes["shape"]``; seconds per
    layer is the wall time over the layer count (reading, calibration set-up and writing included)."""
    from moecompress.checkpoint import resolve_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from synthetic import write_synthetic_qwen3_moe

    layers = 2
    source = work / "large"
    started = time.monotonic()
    write_synthetic_qwen3_moe(source, layers, vocab_dir=resolve_model("builtin:tiny-moe"), **sizes["shape"])
    calibration = {"tokens": sizes["calib_tokens"], "seq_len": sizes["seq_len"]}
    result: dict[str, Any] = {
        "layers": layers,
        "shape": sizes["shape"],
        "calib_tokens": sizes["calib_tokens"],
        "write_seconds": round(time.monotonic() - started, 2),
    }
    steps = {
        "prune_maep": ("prune", dict(method="maep", ratio=0.25)),
        "gptq_int4": ("quantize", dict(scheme="int4", method="gptq")),
        "gptq_int4_lowrank": ("quantize", dict(scheme="int4", method="gptq", lowrank_budget=0.25)),
    }
    for name, (kind, options) in steps.items():
        out = work / f"large-{name}"
        options = {**options, "calibration": calibration, "evaluation": None}
        figures = run_child(kind, device, out, str(source), options, timeout)
        if "seconds" in figures:
            figures["seconds_per_layer"] = figures["seconds"] / layers
        result[name] = {key: figures.get(key) for key in ("seconds", "seconds_per_layer", "error") if key in figures}
        shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(source, ignore_errors=True)
    return result


def kernels(dry_run: bool, work: Path, timeout: float) -> dict[str, Any]:
    """``moecompress bench kernels`` (``--quick`` in the dry run) and its JSON."""
    path = work / "kernels.json"
    args = ["-m", "moecompress.cli.main", "bench", "kernels", "--json-out", str(path)]
    if dry_run:
        args += ["--quick", "--repeats", "1"]
    started = time.monotonic()
    done = python(*args, timeout=timeout)
    figures: dict[str, Any] = {"returncode": done.returncode, "seconds": round(time.monotonic() - started, 2)}
    if path.exists():
        figures["results"] = json.loads(path.read_text())
    if done.returncode:
        figures["error"] = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:400]
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="Every step at tiny sizes on the CPU.")
    parser.add_argument("--device", default="cuda", help="The device checked against the CPU (default cuda).")
    parser.add_argument("--work-dir", type=Path, default=None, help="Where outputs go (a temporary directory).")
    parser.add_argument("--step-timeout", type=float, default=None, help="Seconds per step (default 240; 120 dry).")
    parser.add_argument("--budget", type=float, default=480.0, help="Seconds for the whole check (GPU mode).")
    args = parser.parse_args()
    import torch

    global DEADLINE, IN_PROCESS
    IN_PROCESS = args.dry_run
    if not args.dry_run:
        DEADLINE = time.monotonic() + args.budget
    mode = "dry-run" if args.dry_run else "gpu"
    device = "cpu" if args.dry_run else args.device
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; use --dry-run on a CPU machine", file=sys.stderr)
        return 2
    timeout = args.step_timeout or (120.0 if args.dry_run else 240.0)
    sizes = SIZES[mode]
    work = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.work_dir))
    started = time.monotonic()
    summary: dict[str, Any] = {
        "mode": mode,
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "steps": {},
    }
    steps = {
        "gpu_tests": lambda: gpu_tests(timeout, work),
        "default_recipe": lambda: default_recipe(device, sizes, work, timeout),
        "large_layers": lambda: large_layers(device, sizes, work, timeout),
        "kernels": lambda: kernels(args.dry_run, work, timeout),
    }
    try:
        for name, step in steps.items():
            log(f"{name} ...")
            began = time.monotonic()
            try:
                summary["steps"][name] = step()
            except Exception as error:  # a failed step is reported, and the others still run
                summary["steps"][name] = {"error": f"{type(error).__name__}: {error}"[:400]}
            log(f"{name} done in {time.monotonic() - began:.1f}s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary["seconds"] = round(time.monotonic() - started, 2)
    summary["ok"] = all(_step_ok(step) for step in summary["steps"].values())
    print(json.dumps(summary, indent=1, default=str))
    return 0 if summary["ok"] else 1


def _step_ok(step: dict[str, Any]) -> bool:
    text = json.dumps(step, default=str)
    return '"error"' not in text and step.get("returncode", 0) == 0 and not step.get("failed")


if __name__ == "__main__":
    sys.exit(main())
