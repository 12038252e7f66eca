"""GGUF export and streamed evaluation of an MXFP4 output against copying and evaluating its input (issue 38).

Makes (once, kept in --dir) a one-layer random checkpoint of Qwen3-30B-A3B's layer shapes (128 experts of
2048 x 768) and its ``moecompress quantize --scheme mxfp4`` output, then times, each as its own process:
``cp -r`` of the output, ``moecompress export --format gguf`` of it, ``cp -r`` again, and ``moecompress eval`` of
the input and of the output on the same windows (``--eval-tokens``). Prints wall and CPU seconds and the ratios.

    python scripts/bench_export.py --dir /tmp/bench-export --llama-cpp /tmp/lcp/llama_cpp_python-0.3.36
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import moecompress
from moecompress.synthetic import write_synthetic_qwen3_moe

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--llama-cpp", required=True, help="a llama.cpp checkout or unpacked llama-cpp-python sdist")
    parser.add_argument("--eval-tokens", type=int, default=512)
    parser.add_argument("--no-eval", action="store_true")
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    source, quantized = args.dir / "in", args.dir / "mxfp4"
    if not source.exists():
        write_synthetic_qwen3_moe(source, 1, 2048, 128, 768, BUILTIN, heads=32, kv_heads=4, head_dim=128, top_k=8)
    if not quantized.exists():
        subprocess.run(
            ["moecompress", "quantize", str(source), "--out", str(quantized), "--scheme", "mxfp4", "--no-eval"],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
    copy, gguf = args.dir / "copy", args.dir / "mxfp4.gguf"
    results: dict[str, object] = {"output_bytes": sum(p.stat().st_size for p in quantized.iterdir())}
    runs = []
    for step in ("copy", "export", "copy"):
        shutil.rmtree(copy, ignore_errors=True)
        gguf.unlink(missing_ok=True)
        subprocess.run(["sync"], check=True)
        if step == "copy":
            runs.append(("copy", timed(["cp", "-r", str(quantized), str(copy)], env)))
        else:
            command = ["moecompress", "export", str(quantized), "--format", "gguf", "--out", str(gguf), "--quiet"]
            runs.append(("export", timed([*command, "--llama-cpp", args.llama_cpp], env)))
            results["gguf_bytes"] = gguf.stat().st_size
    shutil.rmtree(copy, ignore_errors=True)
    copies = [r for name, r in runs if name == "copy"]
    export = next(r for name, r in runs if name == "export")
    results["copy"] = copies
    results["export"] = export
    results["export_over_copy_wall"] = round(export["wall_s"] / (sum(c["wall_s"] for c in copies) / len(copies)), 2)
    if not args.no_eval:
        evals = {}
        for name, model in (("input", source), ("output", quantized)):
            out = args.dir / f"eval-{name}.json"
            command = ["moecompress", "eval", str(model), "--eval-tokens", str(args.eval_tokens)]
            command += ["--json-out", str(out)]
            evals[name] = {**timed(command, env), "perplexity": json.loads(out.read_text()).get("perplexity")}
        results["eval"] = evals
        results["eval_output_over_input_wall"] = round(evals["output"]["wall_s"] / evals["input"]["wall_s"], 2)
        results["eval_output_over_input_cpu"] = round(evals["output"]["cpu_s"] / evals["input"]["cpu_s"], 2)
    json.dump(results, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
