"""llama.cpp's own quantiser (``llama-quantize`` with an importance matrix from ``llama-imatrix``) against
moecompress's GGUF at equal or smaller file size, for docs/llama_cpp.md (issue #39's table).

For the model and, with ``--prune-ratio``, its MAEP-pruned copy (``--scope layer``, router refit):

1. ``moecompress export MODEL --format gguf``: the converter's bf16 GGUF;
2. the calibration windows (``builtin:prose``'s calibration part, ``--calib-tokens`` in windows of 256, seed 0)
   decoded and joined into ``calib.txt``; ``llama-imatrix -c 256`` on it;
3. llama.cpp's rows: ``llama-quantize --imatrix`` to each size point (Q2_K, Q3_K_M, Q4_K_M, IQ4_XS);
4. moecompress's rows at each point, ``--target-size`` = llama.cpp's file bytes there: (a) ``quantize --scheme
   q{2,3,4}_k --method gptq --imatrix-out IM`` then ``export --imatrix IM --target-size`` (the widest two schemes
   the export accepts under the budget), (b) ``export MODEL --imatrix IM --target-size`` straight from the bf16
   model, IM from the original model's statistics (``quantize --method rtn --imatrix-out``); the pruned model's
   rows at its own llama.cpp sizes and at the original model's;
5. every file: ``llama-perplexity -c 256 --no-repack`` on ``builtin:prose``'s held-out documents joined by blank
   lines (the running value after ``--chunks`` chunks, each chunk's second half scored), and ``llama-bench`` prefill
   (pp) and decode (tg) tokens/s with ``-t --threads``, the files of one size point measured in alternating rounds.

Every command is recorded in the JSON. The bf16 GGUF, importance matrices, quantised and pruned checkpoints are
kept in ``--work`` and reused by a rerun (delete them after changing the code that makes them). Usage::

    python scripts/llama_cpp_quant_table.py --model DIR --bin LLAMA_BUILD/bin --work DIR \\
        [--json-out docs/llama_cpp_quant_results.json] [--markdown table.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from imatrix_compare import calibration_text, fallbacks, heldout_text, perplexity, run
from prune_table import code_version
from table_io import write_results

POINTS = ("Q2_K", "Q3_K_M", "Q4_K_M", "IQ4_XS")
SCHEMES = ("q4_k", "q3_k", "q2_k")  # widest first
CTX = 256
CALIB = "builtin:prose"


def gguf_facts(path: Path) -> dict[str, Any]:
    """File bytes, weights, bits per weight as llama.cpp's loader prints it (tensor bytes × 8 / weights), and the
    weights held by each GGML type."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    weights = sum(int(t.n_elements) for t in reader.tensors)
    data = sum(int(t.n_bytes) for t in reader.tensors)
    by_type: dict[str, int] = {}
    for tensor in reader.tensors:
        by_type[tensor.tensor_type.name] = by_type.get(tensor.tensor_type.name, 0) + int(tensor.n_elements)
    return {"bytes": path.stat().st_size, "weights": weights, "bpw": 8 * data / weights, "weights_by_type": by_type}


def attempt(command: list[Any]) -> tuple[bool, str]:
    """Run a command that may be refused (exit 2, one line): whether it succeeded, and its last line."""
    done = subprocess.run([str(part) for part in command], capture_output=True, text=True)
    lines = (done.stderr or done.stdout).strip().splitlines()
    return done.returncode == 0, lines[-1] if lines else ""


def once(path: Path, command: list[Any]) -> str:
    """Run ``command`` unless ``path`` (what it writes) is already there; the command as text."""
    if not path.exists():
        run(command)
    return " ".join(map(str, command))


class Model:
    """One model's bf16 GGUF, calibration text, and the three importance matrices."""

    def __init__(self, name: str, model: str, args: argparse.Namespace):
        from moecompress.checkpoint import resolve_model

        self.name, self.model, self.args = name, model, args
        self.work = args.work / name
        self.work.mkdir(parents=True, exist_ok=True)
        self.dir = resolve_model(model)
        self.bf16 = self.work / "bf16.gguf"
        self.commands: dict[str, str] = {}
        self.commands["export_bf16"] = once(self.bf16, [*export_command(model, self.bf16, args)])
        self.calib = self.work / "calib.txt"
        self.windows = calibration_text(self.calib, args.calib_tokens, model)
        self.llama_imatrix = self.work / "llama.imatrix"
        command = [args.bin / "llama-imatrix", "-m", self.bf16, "-f", self.calib, "-o", self.llama_imatrix]
        self.commands["llama_imatrix"] = once(self.llama_imatrix, [*command, "-c", CTX, "-t", args.threads, "--no-ppl"])
        self.bf16_ppl = perplexity(args.bin, self.bf16, args.work / "heldout.txt", args.threads, args.chunks)
        self.rtn_imatrix = self.work / "rtn.imatrix"
        self.commands["rtn_imatrix"] = once(self.rtn_imatrix, self.quantize_command("q4_k", "rtn", self.rtn_imatrix))

    def quantize_command(self, scheme: str, method: str, imatrix: Path) -> list[Any]:
        out = self.work / f"{scheme}-{method}"
        command = ["moecompress", "quantize", self.model, "--out", out, "--overwrite", "--scheme", scheme]
        command += ["--method", method, "--imatrix-out", imatrix, "--calib", CALIB]
        return [*command, "--calib-tokens", self.args.calib_tokens, "--seq-len", CTX, "--no-eval", "--quiet"]

    def quantized(self, scheme: str) -> tuple[Path, Path]:
        """``quantize --scheme scheme --method gptq``'s checkpoint and importance matrix."""
        imatrix = self.work / f"{scheme}-gptq.imatrix"
        self.commands[f"quantize_{scheme}"] = once(imatrix, self.quantize_command(scheme, "gptq", imatrix))
        return self.work / f"{scheme}-gptq", imatrix


def export_command(model: Any, out: Path, args: argparse.Namespace) -> list[Any]:
    command = ["moecompress", "export", model, "--format", "gguf", "--out", out, "--overwrite", "--quiet"]
    return [*command, "--llama-cpp", args.llama_cpp] if args.llama_cpp else command


def measure(row: dict[str, Any], gguf: Path, args: argparse.Namespace, heldout: Path) -> dict[str, Any]:
    row.update(gguf_facts(gguf), file=str(gguf))
    row["ppl"] = perplexity(args.bin, gguf, heldout, args.threads, args.chunks)
    return row


def llama_rows(model: Model, args: argparse.Namespace, heldout: Path) -> list[dict[str, Any]]:
    rows = []
    for point in args.points.split(","):
        out = model.work / f"llama-{point}.gguf"
        command = [args.bin / "llama-quantize", "--imatrix", model.llama_imatrix, model.bf16, out, point, args.threads]
        log = run(command)
        row = {"model": model.name, "route": "llama-quantize + llama-imatrix", "point": point, "budget_from": None}
        row.update(command=" ".join(map(str, command)), fallbacks=fallbacks(log))
        rows.append(measure(row, out, args, heldout))
    return rows


def our_rows(model: Model, budget: dict[str, Any], fits: int, args: argparse.Namespace, heldout: Path) -> list[dict]:
    """moecompress at ``budget`` (a llama.cpp row): route (a) with the widest ``fits`` schemes the export fits
    (refusals are rows too), then (b)."""
    rows: list[dict[str, Any]] = []
    size, tag = budget["bytes"], f"{budget['model']}-{budget['point']}"
    routes: list[tuple[str, Any, Path, str]] = []
    for scheme in SCHEMES:
        checkpoint, imatrix = model.quantized(scheme)
        routes.append((f"quantize {scheme} gptq + export", checkpoint, imatrix, f"{scheme}-gptq"))
    routes.append(("export from bf16", model.model, model.rtn_imatrix, "bf16"))
    fitted = 0
    for label, source, imatrix, name in routes:
        if name != "bf16" and fitted == fits:
            continue
        out = model.work / f"ours-{name}-at-{tag}.gguf"
        command = [*export_command(source, out, args), "--imatrix", imatrix, "--target-size", size]
        ok, last = attempt(command)
        row = {"model": model.name, "route": label, "point": budget["point"], "budget_from": budget["model"]}
        row.update(budget=size, command=" ".join(map(str, command)))
        if not ok:
            rows.append({**row, "refused": last})
            continue
        fitted += name != "bf16"
        report = out.with_name(out.name + ".report.json")
        row["report"] = str(report) if report.exists() else None
        rows.append(measure(row, out, args, heldout))
    return rows


def bench_command(file: str, args: argparse.Namespace) -> list[Any]:
    command = [args.bin / "llama-bench", "-m", file, "-p", args.pp, "-n", args.tg, "-t", args.threads]
    return [*command, "-r", args.bench_reps, "--repack", args.repack, "--prio", args.prio, "-o", "json"]


def bench(files: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Prefill and decode tokens/s per file: ``--bench-rounds`` rounds, each running every file once in turn
    (``-r --bench-reps``), so that the load of a shared machine falls on all files alike; medians of all samples."""
    samples: dict[str, dict[str, list[float]]] = {f: {"pp": [], "tg": []} for f in files}
    for _ in range(args.bench_rounds):
        for file in files:
            command = [str(part) for part in bench_command(file, args)]
            for test in json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout):
                samples[file]["pp" if test["n_prompt"] else "tg"] += test["samples_ts"]
    return {
        file: {
            "pp_tps": statistics.median(values["pp"]),
            "tg_tps": statistics.median(values["tg"]),
            "bench_samples": values,
            "bench_command": " ".join(map(str, bench_command(file, args))),
        }
        for file, values in samples.items()
    }


def render(results: dict[str, Any]) -> str:
    """The measured rows (refusals are in the JSON): per size point llama.cpp's file, then ours at its size."""
    lines = [
        "| model | size point | route | GGML types (share of weights) | file bytes | bits/weight "
        "| llama-perplexity | vs llama.cpp | pp t/s | tg t/s | tg vs llama.cpp |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    llama = {(r["model"], r["point"]): r for r in results["rows"] if r["budget_from"] is None}
    for row in results["rows"]:
        if "refused" in row:
            continue
        base = llama[(row["budget_from"] or row["model"], row["point"])]
        budget = f" (at {row['budget_from']}'s size)" if row["budget_from"] not in (None, row["model"]) else ""
        shares = {k: v / row["weights"] for k, v in sorted(row["weights_by_type"].items())}
        types = ", ".join(f"{k} {share:.0%}" for k, share in shares.items() if share >= 0.005)  # not the norms
        versus = "—" if row is base else f"{100 * (row['ppl'] / base['ppl'] - 1):+.2f}%"
        speed = f"{row['pp_tps']:.0f} | {row['tg_tps']:.0f} | {row['tg_vs_llama']:.3f}" if "tg_tps" in row else "| |"
        lines.append(
            f"| {row['model']} | {row['point']}{budget} | {row['route']} | {types} | {row['bytes']:,} "
            f"| {row['bpw']:.3f} | {row['ppl']:.4f} | {versus} | {speed} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a trained model directory (widths multiples of 256)")
    parser.add_argument("--bin", type=Path, default=os.environ.get("MOECOMPRESS_LLAMA_CPP_BIN"))
    parser.add_argument("--llama-cpp", default=None, help="the converter (default: $MOECOMPRESS_LLAMA_CPP)")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--chunks", type=int, default=128, help="held-out chunks of 256 tokens llama-perplexity scores")
    parser.add_argument("--prune-ratio", type=float, default=0.25, help="MAEP ratio of the pruned rows (0: none)")
    parser.add_argument("--points", default=",".join(POINTS), help="llama-quantize types, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pp", type=int, default=256, help="llama-bench prompt tokens")
    parser.add_argument("--tg", type=int, default=64, help="llama-bench generated tokens")
    parser.add_argument("--bench-rounds", type=int, default=3)
    parser.add_argument("--bench-reps", type=int, default=3)
    parser.add_argument("--repack", type=int, default=0, help="llama-bench --repack: this build crashes with 1")
    parser.add_argument("--prio", type=int, default=2, help="llama-bench --prio (2: nice -10, on a shared machine)")
    parser.add_argument("--json-out", type=Path, default=Path("docs/llama_cpp_quant_results.json"))
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    args.work, args.bin = args.work.absolute(), Path(args.bin).absolute()
    args.work.mkdir(parents=True, exist_ok=True)
    heldout = args.work / "heldout.txt"
    heldout_text(heldout)
    start = time.time()

    models = [Model("original", args.model, args)]
    if args.prune_ratio:
        pruned = args.work / "checkpoints" / f"maep{round(100 * args.prune_ratio)}"
        command = ["moecompress", "prune", args.model, "--out", pruned, "--method", "maep", "--ratio", args.prune_ratio]
        command += ["--scope", "layer", "--recalibrate-router", "--calib", CALIB, "--calib-tokens", args.calib_tokens]
        prune = once(pruned, [*command, "--seq-len", CTX, "--no-eval", "--quiet"])
        models.append(Model(pruned.name, str(pruned), args))
        models[-1].commands["prune"] = prune

    rows: list[dict[str, Any]] = []
    baselines = {m.name: llama_rows(m, args, heldout) for m in models}
    ours = "--target-size" in run(["moecompress", "export", "--help"])
    if not ours:
        print("moecompress export has no --target-size yet: llama.cpp's rows only", flush=True)
    for model in models:
        rows += baselines[model.name]
        budgets = baselines[model.name] + (baselines["original"] if model.name != "original" else [])
        for budget in budgets if ours else []:
            rows += our_rows(model, budget, 2 if model.name == "original" else 1, args, heldout)
            for row in [budget, *rows[-1:]]:
                print(row["model"], row["point"], row["route"], row.get("bytes"), row.get("ppl"), row.get("refused"))
    facts = {
        "date": time.strftime("%Y-%m-%d"),
        "code": code_version(),
        "model": args.model,
        "bf16": {m.name: {"bytes": m.bf16.stat().st_size, "ppl": m.bf16_ppl} for m in models},
        "heldout_tokens_scored": args.chunks * CTX // 2,
        "heldout_text_tokens_read": (args.chunks + 1) * CTX,
        "calibration_windows": {m.name: m.windows for m in models},
        "calib_tokens": args.calib_tokens,
        "threads": args.threads,
        "bench": {"pp": args.pp, "tg": args.tg, "rounds": args.bench_rounds, "reps": args.bench_reps},
        "commands": {m.name: m.commands for m in models},
    }
    write_results({**facts, "rows": rows}, args.json_out, None, render)  # kept if the benchmark fails
    for llama in (r for r in rows if r["budget_from"] is None):
        group = [llama] + [r for r in rows if (r["budget_from"], r["point"]) == (llama["model"], llama["point"])]
        group = [r for r in group if "refused" not in r]
        speeds = bench([r["file"] for r in group], args)
        for row in group:
            row.update(speeds[row["file"]], tg_vs_llama=speeds[row["file"]]["tg_tps"] / speeds[llama["file"]]["tg_tps"])
    results = {**facts, "seconds": time.time() - start, "rows": rows}
    write_results(results, args.json_out, args.markdown, render)
    print(render(results))


if __name__ == "__main__":
    main()
