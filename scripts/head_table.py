"""Compare attention-head selection on builtin:tiny-moe: learned gates (with and without the noise bias) vs
weight magnitude vs random, removing 25% and 50% of each layer's KV groups, before and after distillation.

Run: python scripts/head_table.py [--out docs/heads_results.json] [--markdown docs/heads_table.md]
Every number in docs/heads.md comes from this script. Random selection is averaged over --random-seeds seeds.
Held-out perplexity is measured on the written checkpoints (after distillation) and on the pruned model in memory
(before it), both on --eval-data, which the gates and distillation never see.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch
from table_io import run_facts, write_results

from moecompress.checkpoint import resolve_model
from moecompress.loading import quiet_transformers
from moecompress.passes.prune_heads import PruneHeadsConfig, prune_heads

# "learned" is the noise-biased variant (bias 2.0, decaying to 0 over the warm-up); the pass's default is no bias.
VARIANTS = {
    "learned": {"method": "learned", "noise_bias": 2.0},
    "learned, no noise bias": {"method": "learned", "noise_bias": 0.0},
    "magnitude": {"method": "magnitude"},
    "random": {"method": "random"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-moe")
    parser.add_argument(
        "--calib",
        default="builtin:code:heldout",
        help="gate and distillation data; tiny-moe was trained on builtin:prose:calib and memorised it",
    )
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--eval-data", default="builtin:prose:heldout")
    parser.add_argument("--eval-tokens", type=int, default=16384)
    parser.add_argument("--ratios", default="0.25,0.5")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--distill-steps", type=int, default=100)
    parser.add_argument("--random-seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per job (0: torch's default)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel processes")
    parser.add_argument("--out", type=Path, default=Path("docs/heads_results.json"))
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_transformers()
    jobs = [
        (name, float(ratio), seed)
        for ratio in args.ratios.split(",")
        for name, variant in VARIANTS.items()
        for seed in (range(args.random_seeds) if variant["method"] == "random" else [0])
    ]
    with tempfile.TemporaryDirectory() as tmp, multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        reports = pool.starmap(_run, [(job, args, Path(tmp)) for job in jobs])
    rows = []
    for name, ratio in dict.fromkeys((name, ratio) for name, ratio, _ in jobs):
        rows.append(_row(name, ratio, [r for job, r in zip(jobs, reports, strict=True) if job[:2] == (name, ratio)]))
    results = {"facts": run_facts(args), "reference_perplexity": rows[0]["reference_perplexity"], "rows": rows}
    write_results(results, args.out, args.markdown, lambda r: _markdown(r["rows"], r["reference_perplexity"]))


def _run(job: tuple[str, float, int], args: argparse.Namespace, tmp: Path) -> dict:
    name, ratio, seed = job
    if args.threads:
        torch.set_num_threads(args.threads)
    quiet_transformers()
    started = time.time()
    config = PruneHeadsConfig(
        ratio=ratio, steps=args.steps, distill_steps=args.distill_steps, seed=seed, **VARIANTS[name]
    )
    report = prune_heads(
        resolve_model(args.model),
        tmp / f"{name}-{ratio}-{seed}",
        config,
        calib=args.calib,
        calib_tokens=args.calib_tokens,
        eval_data=args.eval_data,
        eval_tokens=args.eval_tokens,
        progress=False,
    )
    print(
        f"{name} ratio {ratio} seed {seed}: {report['eval_before_distillation']['perplexity']:.3f} -> "
        f"{report['eval']['perplexity']:.3f} ({time.time() - started:.0f}s)",
        flush=True,
    )
    return report


def _row(name: str, ratio: float, runs: list[dict]) -> dict:
    before = [r["eval_before_distillation"]["perplexity"] for r in runs]
    after = [r["eval"]["perplexity"] for r in runs]
    first = runs[0]
    return {
        "method": name,
        "ratio": ratio,
        "seeds": len(runs),
        "perplexity_before_distillation": statistics.mean(before),
        "perplexity_after_distillation": statistics.mean(after),
        "perplexity_before_distillation_per_seed": before,
        "perplexity_after_distillation_per_seed": after,
        "kl_before_distillation": statistics.mean(r["eval_before_distillation"]["kl"] for r in runs),
        "kl_after_distillation": statistics.mean(r["eval"]["kl"] for r in runs),
        "reference_perplexity": first["eval"]["reference_perplexity"],
        "kv_cache_bytes_per_token": first["kv_cache_bytes_per_token"],
        "removed_kv_groups": [{layer: info["removed_units"] for layer, info in r["layers"].items()} for r in runs],
        "seconds": [r["seconds"] for r in runs],
    }


def _markdown(rows: list[dict], baseline: float) -> str:
    kv = rows[0]["kv_cache_bytes_per_token"]["before"]
    lines = [
        f"Unpruned: perplexity {baseline:.3f}, KV cache {kv} bytes/token.",
        "",
        "| KV groups removed | method | KV cache bytes/token | perplexity, pruned | perplexity, distilled |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        seeds = f" (mean of {row['seeds']} seeds)" if row["seeds"] > 1 else ""
        lines.append(
            f"| {row['ratio']:.0%} | {row['method']}{seeds} | {row['kv_cache_bytes_per_token']['after']} | "
            f"{row['perplexity_before_distillation']:.3f} | {row['perplexity_after_distillation']:.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
