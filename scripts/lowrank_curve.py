"""Held-out perplexity against low-rank budget on builtin:tiny-moe: none / uniform / load-aware adapters after
MXFP4 RTN and INT2 RTN quantisation, on the same model, calibration and evaluation data.

Run: python scripts/lowrank_curve.py [--out docs/lowrank_results.json] [--markdown docs/lowrank_table.md]
                                     [--png docs/lowrank_curve.png]
Budgets are in bits per routed expert weight; the defaults buy whole ranks per matrix for the uniform baseline
(0.1875 bits = rank 1 everywhere on this model), so both allocations spend the same number of components.
Every number and the picture in docs/lowrank.md come from this script.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from table_io import run_facts, write_results

from moecompress.checkpoint import resolve_model
from moecompress.evals.perplexity import evaluate
from moecompress.loading import quiet_transformers
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint
from moecompress.quantization.sensitivity import SENSITIVITIES

SCHEMES = {"mxfp4 rtn": dict(scheme="mxfp4"), "int2 g32 asym rtn": dict(scheme="int2", group_size=32)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-moe")
    parser.add_argument("--calib", default="builtin:prose")
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--data", default="builtin:prose:heldout")
    parser.add_argument("--budgets", default="0.1875,0.375,0.75,1.5")
    parser.add_argument("--out", type=Path, default=Path("docs/lowrank_results.json"))
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument(
        "--sensitivity",
        choices=SENSITIVITIES,
        default=QuantizeConfig.sensitivity,
        help="downstream factor on the low-rank objective, for both allocations (see docs/lowrank.md)",
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    model_dir = resolve_model(args.model)
    base = evaluate(model_dir, args.data, progress=False)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in SCHEMES.items():
            runs = [("none", 0.0, "none")] + [
                (alloc, float(b), sensitivity)
                for b in args.budgets.split(",")
                for alloc, sensitivity in allocations(args.sensitivity)
            ]
            for alloc, budget, sensitivity in runs:
                out = Path(tmp) / f"{len(rows)}"
                config = QuantizeConfig(
                    **options,
                    lowrank_budget=budget,
                    rank_alloc=alloc if budget else "load",
                    sensitivity=sensitivity,
                )
                report = quantize_checkpoint(
                    model_dir, out, config, calib=args.calib, calib_tokens=args.calib_tokens, progress=False
                )
                result = evaluate(out, args.data, reference_dir=model_dir, progress=False)
                lowrank = report.get("lowrank", {})
                row = dict(
                    scheme=name,
                    allocation=alloc,
                    sensitivity=sensitivity,
                    budget=budget,
                    perplexity=result.perplexity,
                    kl=result.kl,
                    routing_agreement=result.routing_agreement,
                    expert_bits=report["footprint"]["classes"]["experts"]["bits_per_weight"],
                    components=lowrank.get("components_used", 0),
                    predicted_error=lowrank.get("predicted_weighted_error", {}).get("with_adapters"),
                    measured_error=lowrank.get("measured_weighted_error", {}).get("with_adapters"),
                    error_without=lowrank.get("measured_weighted_error", {}).get("without_adapters"),
                )
                rows.append(row)
                print(
                    f"{name:18s} {alloc:8s} {sensitivity:12s} budget {budget:6.4f} ppl {row['perplexity']:8.3f} "
                    f"kl {row['kl']:.4f} bits {row['expert_bits']:.3f} components {row['components']}",
                    flush=True,
                )
    results = dict(
        **run_facts(args),
        sensitivity=args.sensitivity,
        baseline_perplexity=base.perplexity,
        rows=rows,
    )
    write_results(results, args.out, args.markdown, render_markdown)
    if args.png:
        plot(results, args.png)


def allocations(sensitivity: str) -> list[tuple[str, str]]:
    """Uniform and load-aware ranks fitted to the same objective, and uniform ranks on the plain (sensitivity
    ``none``) objective, the baseline before any downstream weighting."""
    pairs = [("uniform", sensitivity), ("load", sensitivity)]
    return pairs if sensitivity == "none" else [("uniform", "none"), *pairs]


def _label(row: dict) -> str:
    return row["allocation"] if row["budget"] == 0 else f"{row['allocation']}, {row['sensitivity']}"


def render_markdown(results: dict) -> str:
    lines = [
        f"bf16 original: perplexity {results['baseline_perplexity']:.2f} on `{results['data']}`.",
        "",
        "| quantisation | adapters, sensitivity | budget (bits/expert weight) | components | expert bits/weight "
        "| perplexity | KL (nats/token) | weighted error measured (predicted) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        error = (
            f"{row['measured_error']:.4g} ({row['predicted_error']:.4g})" if row["measured_error"] is not None else "—"
        )
        lines.append(
            f"| {row['scheme']} | {_label(row)} | {row['budget']:g} | {row['components']} | "
            f"{row['expert_bits']:.3f} | {row['perplexity']:.2f} | {row['kl']:.4f} | {error} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schemes = list(dict.fromkeys(row["scheme"] for row in results["rows"]))
    figure, grid = plt.subplots(2, len(schemes), figsize=(5.5 * len(schemes), 7.5), squeeze=False)
    for column, scheme in enumerate(schemes):
        _plot_metric(grid[0][column], results, scheme, "perplexity", "held-out perplexity")
        _plot_metric(grid[1][column], results, scheme, "kl", "KL to bf16 (nats/token)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _plot_metric(axis, results: dict, scheme: str, metric: str, label: str) -> None:
    rows = [r for r in results["rows"] if r["scheme"] == scheme]
    none = next(r for r in rows if r["allocation"] == "none")
    budgets = sorted({r["budget"] for r in rows if r["budget"] > 0})
    axis.axhline(none[metric], color="grey", linestyle="--", label="no adapters")
    if metric == "perplexity":
        axis.axhline(results["baseline_perplexity"], color="black", linestyle=":", label="bf16 original")
    for (alloc, sensitivity), marker in zip(allocations(results["sensitivity"]), "^so", strict=False):
        values = [
            next(
                r[metric]
                for r in rows
                if r["allocation"] == alloc and r["sensitivity"] == sensitivity and r["budget"] == b
            )
            for b in budgets
        ]
        axis.plot(budgets, values, marker=marker, label=f"{alloc} ranks, sensitivity {sensitivity}")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("adapter budget (bits per routed expert weight)")
    axis.set_ylabel(label)
    axis.set_title(f"builtin:tiny-moe, {scheme}")
    axis.legend()


if __name__ == "__main__":
    main()
