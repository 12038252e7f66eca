"""Compare expert-pruning methods on builtin:tiny-moe: method × ratio × scope → perplexity, agreement, bytes.

Run: python scripts/prune_table.py [--out docs/pruning_results.json] [--markdown docs/pruning.md]
Every number in docs/pruning.md comes from this script. Random pruning is averaged over --random-seeds seeds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from table_io import run_facts, write_results

from moecompress.checkpoint import CheckpointReader, resolve_model
from moecompress.evals.perplexity import evaluate
from moecompress.loading import quiet_transformers
from moecompress.passes.prune_experts import PruneExpertsConfig, prune_experts

METHODS = ("maep", "reap", "frequency", "random")
# MAEP ablations shown beside the default: the plain mean of ‖ΔH‖, and greedy re-scored removal.
VARIANTS = {"maep": {}, "maep (mean ‖ΔH‖)": {"aggregate": "mean"}, "maep (greedy)": {"greedy": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-moe")
    parser.add_argument("--calib", default="builtin:prose")
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--data", default="builtin:prose:heldout")
    parser.add_argument("--second-data", default="builtin:code:heldout", help="a second, out-of-domain check")
    parser.add_argument("--second-tokens", type=int, default=32768)
    parser.add_argument("--ratios", default="0.25,0.5")
    parser.add_argument("--scopes", default="layer,global")
    parser.add_argument("--random-seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/pruning_results.json"))
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    quiet_transformers()

    model_dir = resolve_model(args.model)
    base = evaluate(model_dir, args.data, progress=False)
    base_second = evaluate(model_dir, args.second_data, max_tokens=args.second_tokens, progress=False)
    with CheckpointReader(model_dir) as reader:
        base_bytes = reader.total_bytes()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ratio in map(float, args.ratios.split(",")):
            for scope in args.scopes.split(","):
                for name in [*VARIANTS, *METHODS[1:]]:
                    method = "maep" if name in VARIANTS else name
                    options = VARIANTS.get(name, {})
                    seeds = range(args.random_seeds) if method == "random" else [0]
                    runs = []
                    for seed in seeds:
                        out = Path(tmp) / f"{len(rows)}-{seed}"
                        config = PruneExpertsConfig(method=method, ratio=ratio, scope=scope, seed=seed, **options)
                        start = time.time()
                        report = prune_experts(
                            model_dir, out, config, calib=args.calib, calib_tokens=args.calib_tokens, progress=False
                        )
                        seconds = time.time() - start
                        result = evaluate(out, args.data, reference_dir=model_dir, progress=False)
                        second = evaluate(out, args.second_data, max_tokens=args.second_tokens, progress=False)
                        with CheckpointReader(out) as reader:
                            size = reader.total_bytes()
                        runs.append(
                            dict(
                                perplexity=result.perplexity,
                                second_perplexity=second.perplexity,
                                routing_agreement=result.routing_agreement,
                                kl=result.kl,
                                bytes=size,
                                prune_seconds=seconds,
                                kept_per_layer=[len(v["kept"]) for v in report["layers"].values()],
                            )
                        )
                    row = dict(
                        method=name,
                        ratio=ratio,
                        scope=scope,
                        seeds=len(runs),
                        perplexity=statistics.mean(r["perplexity"] for r in runs),
                        perplexity_runs=[r["perplexity"] for r in runs],
                        second_perplexity=statistics.mean(r["second_perplexity"] for r in runs),
                        routing_agreement=statistics.mean(r["routing_agreement"] for r in runs),
                        kl=statistics.mean(r["kl"] for r in runs),
                        bytes=runs[0]["bytes"],
                        kept_per_layer=runs[0]["kept_per_layer"],
                        prune_seconds=statistics.mean(r["prune_seconds"] for r in runs),
                    )
                    rows.append(row)
                    print(
                        f"{name:18s} ratio {ratio:.2f} {scope:6s} ppl {row['perplexity']:8.3f} "
                        f"agree {row['routing_agreement']:.4f} kl {row['kl']:.4f} kept {row['kept_per_layer']}",
                        flush=True,
                    )
    results = dict(
        **run_facts(args),
        baseline=dict(
            perplexity=base.perplexity, second_perplexity=base_second.perplexity, bytes=base_bytes, tokens=base.tokens
        ),
        rows=rows,
    )
    write_results(results, args.out, args.markdown, render_markdown)


def render_markdown(results: dict) -> str:
    base = results["baseline"]
    lines = [
        "| method | removed | scope | prose perplexity | code perplexity | routing agreement | KL (nats/token) "
        "| kept per layer | bytes |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| none (original) | 0% | — | {base['perplexity']:.2f} | {base['second_perplexity']:.2f} | 1.0000 | 0 "
        f"| 8, 8, 8, 8 | {base['bytes']:,} |",
    ]
    for row in results["rows"]:
        name = row["method"] + (f" (mean of {row['seeds']} seeds)" if row["seeds"] > 1 else "")
        lines.append(
            f"| {name} | {row['ratio']:.0%} | {row['scope']} | {row['perplexity']:.2f} | "
            f"{row['second_perplexity']:.2f} | {row['routing_agreement']:.4f} | {row['kl']:.4f} | "
            f"{', '.join(map(str, row['kept_per_layer']))} | {row['bytes']:,} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
