"""GGUF export and streamed evaluation of an MXFP4 output against copying and evaluating its input (issue 38).

Makes (once, kept in --dir) random checkpoints of Qwen3-30B-A3B's layer shapes (128 experts of 2048 x 768) with
1 and ``--layers`` layers, and their ``moecompress quantize --scheme mxfp4`` outputs. For each, ``--repeats``
times, side by side: ``cp -r`` of the output and ``moecompress export --format gguf`` of it, each a fresh process;
then, in this (warm) process, ``shutil.copytree`` of the output and the export as an API call (``export_gguf``,
the first call of which warms the process up and is reported apart). Optionally ``moecompress eval`` of the
1-layer input and output on the same windows (``--eval``). Prints wall and CPU seconds and the ratios (medians).

    python scripts/bench_export.py --dir /tmp/bench-export --llama-cpp /tmp/lcp/llama_cpp_python-0.3.36
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import moecompress
from moecompress.export.to_gguf import export_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synthetic import write_synthetic_qwen3_moe

BUILTIN = Path(moecompress.__file__).parent / "assets" / "tiny-moe"


def timed(command: list[str], env: dict[str, str]) -> dict[str, float]:
    """Wall and CPU (user + sys, of the command and its children) seconds of ``command``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def timed_here(call: Callable[[], object]) -> dict[str, float]:
    """Wall and CPU seconds of ``call`` in this process (its children's CPU included)."""
    before, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    call()
    wall = time.perf_counter() - start
    after, children_after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = sum(getattr(after, f) - getattr(before, f) for f in ("ru_utime", "ru_stime"))
    cpu += sum(getattr(children_after, f) - getattr(children, f) for f in ("ru_utime", "ru_stime"))
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}


def quantized_checkpoint(directory: Path, layers: int, env: dict[str, str]) -> Path:
    source, quantized = directory / f"in-{layers}", directory / f"mxfp4-{layers}"
    if not quantized.exists():
        if not source.exists():
            write_synthetic_qwen3_moe(
                source, layers, 2048, 128, 768, BUILTIN, heads=32, kv_heads=4, head_dim=128, top_k=8
            )
        command = ["moecompress", "quantize", str(source), "--out", str(quantized), "--scheme", "mxfp4", "--no-eval"]
        subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    return quantized.resolve()  # a link to a checkpoint made elsewhere: cp -r would copy the link


def median(runs: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(run[key] for run in runs), 3)


def compare_export_with_copy(quantized: Path, work: Path, llama_cpp: str, repeats: int, env: dict[str, str]):
    copy, gguf = work / "copy", work / "out.gguf"

    def fresh() -> None:
        shutil.rmtree(copy, ignore_errors=True)
        gguf.unlink(missing_ok=True)
        subprocess.run(["sync"], check=True)

    def api_export() -> None:
        export_gguf(quantized, gguf, llama_cpp=llama_cpp, progress=False)

    cli = ["moecompress", "export", str(quantized), "--format", "gguf", "--out", str(gguf), "--quiet"]
    cli += ["--llama-cpp", llama_cpp]
    runs: dict[str, list[dict[str, float]]] = {"cp -r": [], "CLI export": [], "copytree": [], "API export": []}
    fresh()
    first_api = timed_here(api_export)
    for _ in range(repeats):
        fresh()
        runs["cp -r"].append(timed(["cp", "-r", str(quantized), str(copy)], env))
        fresh()
        runs["CLI export"].append(timed(cli, env))
        fresh()
        runs["copytree"].append(timed_here(lambda: shutil.copytree(quantized, copy)))
        fresh()
        runs["API export"].append(timed_here(api_export))
    result: dict[str, object] = {
        "output_bytes": sum(p.stat().st_size for p in quantized.iterdir()),
        "gguf_bytes": gguf.stat().st_size,
        "first_API_export_in_this_process": first_api,
        "runs": runs,
    }
    fresh()
    for what, against in (("CLI export", "cp -r"), ("API export", "copytree")):
        for key in ("wall_s", "cpu_s"):
            result[f"{what} / {against} ({key}, medians)"] = round(
                median(runs[what], key) / max(median(runs[against], key), 1e-3), 2
            )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--llama-cpp", required=True, help="a llama.cpp checkout or unpacked llama-cpp-python sdist")
    parser.add_argument("--layers", type=int, default=4, help="layers of the second checkpoint (0: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eval", action="store_true", help="also time moecompress eval of the 1-layer model")
    parser.add_argument("--eval-tokens", type=int, default=512)
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    args.dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, object] = {"loadavg_before": Path("/proc/loadavg").read_text().split()[:3]}
    for layers in sorted({1, args.layers} - {0}):
        quantized = quantized_checkpoint(args.dir, layers, env)
        work = args.dir / f"work-{layers}"
        work.mkdir(exist_ok=True)
        results[f"{layers} layer(s)"] = compare_export_with_copy(quantized, work, args.llama_cpp, args.repeats, env)
    if args.eval:
        evals = {}
        for name, model in (("input", args.dir / "in-1"), ("output", args.dir / "mxfp4-1")):
            out = args.dir / f"eval-{name}.json"
            command = ["moecompress", "eval", str(model), "--eval-tokens", str(args.eval_tokens)]
            command += ["--json-out", str(out)]
            evals[name] = {**timed(command, env), "perplexity": json.loads(out.read_text()).get("perplexity")}
        results["eval"] = evals
        results["eval_output_over_input_wall"] = round(evals["output"]["wall_s"] / evals["input"]["wall_s"], 2)
        results["eval_output_over_input_cpu"] = round(evals["output"]["cpu_s"] / evals["input"]["cpu_s"], 2)
    results["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    json.dump(results, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
