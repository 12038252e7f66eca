"""Routing-replay QAT on builtin:tiny-moe: PTQ (RTN + load-aware adapters) against QAT of the same adapters with
and without replayed routes, at equal steps, seed and adapter budget, for INT2 and MXFP4: held-out perplexity,
KL and routing agreement with the full-precision model, expert bits per weight, and the loss curves.

Run: python scripts/qat_table.py [--out docs/qat_results.json] [--markdown docs/qat_table.md] [--plot docs/qat_loss.png]
Every number in docs/qat.md comes from this script.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from table_io import run_facts, write_results

from moecompress.checkpoint import resolve_model
from moecompress.loading import quiet_transformers
from moecompress.passes.qat import QATConfig, qat_checkpoint
from moecompress.passes.quantize import QuantizeConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-moe")
    parser.add_argument("--data", default="builtin:prose", help="training and PTQ calibration source")
    parser.add_argument("--eval-data", default="builtin:prose:heldout")
    parser.add_argument("--schemes", default="int2,mxfp4")
    parser.add_argument("--replays", default="all,none", help="comma-separated --replay schedules")
    parser.add_argument("--replay-weights", default="router")
    parser.add_argument("--budget", type=float, default=0.375, help="adapter bits per expert weight")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/qat_results.json"))
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="PNG of the loss curves (needs matplotlib)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()

    model_dir = resolve_model(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in args.schemes.split(","):
            for replay in args.replays.split(","):
                config = QATConfig(
                    quantize=QuantizeConfig(scheme=scheme, lowrank_budget=args.budget),
                    replay=replay,
                    replay_weights=args.replay_weights,
                    steps=args.steps,
                    lr=args.lr,
                    seed=args.seed,
                )
                start = time.time()
                report = qat_checkpoint(
                    model_dir,
                    Path(tmp) / f"{len(rows)}",
                    config,
                    data=args.data,
                    eval_data=args.eval_data,
                    eval_tokens=None,
                    progress=False,
                )
                before, after = report["eval"]["before"], report["eval"]["after"]
                row = dict(
                    scheme=report["scheme_description"],
                    replay=report["qat"]["replay"],
                    reference_perplexity=before["reference_perplexity"],
                    ptq_perplexity=before["perplexity"],
                    ptq_kl=before["kl"],
                    ptq_routing_agreement=before["routing_agreement"],
                    perplexity=after["perplexity"],
                    kl=after["kl"],
                    routing_agreement=after["routing_agreement"],
                    expert_bits=report["footprint"]["classes"]["experts"]["bits_per_weight"],
                    adapter_parameters=report["qat"]["trainable_parameters"],
                    loss=report["qat"]["loss"],
                    own_route_agreement=report["qat"]["own_route_agreement"],
                    tokens=after["tokens"],
                    train_seconds=report["qat"]["train_seconds"],
                    seconds=time.time() - start,
                )
                rows.append(row)
                print(
                    f"{row['scheme']:28s} replay {row['replay']:10s} PTQ {row['ptq_perplexity']:.3f} -> QAT "
                    f"{row['perplexity']:.3f} (KL {row['ptq_kl']:.4f} -> {row['kl']:.4f}, agreement "
                    f"{row['ptq_routing_agreement']:.4f} -> {row['routing_agreement']:.4f}) {row['seconds']:.0f}s",
                    flush=True,
                )
    facts = run_facts(args)
    facts.update(steps=args.steps, lr=args.lr, seed=args.seed, budget=args.budget, replay_weights=args.replay_weights)
    results = dict(**facts, rows=rows)
    write_results(results, args.out, args.markdown, render_markdown)
    if args.plot:
        plot_losses(results, args.plot)


def render_markdown(results: dict) -> str:
    lines = [
        f"{results['steps']} steps, lr {results['lr']:g}, seed {results['seed']}, adapters "
        f"{results['budget']:g} bits/expert weight spent by load; replayed weights: {results['replay_weights']}. "
        f"Full-precision perplexity {results['rows'][0]['reference_perplexity']:.2f} "
        f"({results['rows'][0]['tokens']:,} held-out tokens).",
        "",
        "| experts | expert bits/weight | method | perplexity | KL (nats/token) | routing agreement |",
        "|---|---|---|---|---|---|",
    ]
    seen_ptq = set()
    for row in results["rows"]:
        if row["scheme"] not in seen_ptq:
            seen_ptq.add(row["scheme"])
            lines.append(
                f"| {row['scheme']} | {row['expert_bits']:.3f} | PTQ (RTN + load-aware adapters) | "
                f"{row['ptq_perplexity']:.2f} | {row['ptq_kl']:.4f} | {row['ptq_routing_agreement']:.4f} |"
            )
        lines.append(
            f"| {row['scheme']} | {row['expert_bits']:.3f} | QAT, replay {row['replay']} | {row['perplexity']:.2f} | "
            f"{row['kl']:.4f} | {row['routing_agreement']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def plot_losses(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schemes = list(dict.fromkeys(row["scheme"] for row in results["rows"]))
    figure, axes = plt.subplots(1, len(schemes), figsize=(5.5 * len(schemes), 4), squeeze=False)
    for axis, scheme in zip(axes[0], schemes, strict=True):
        for row in results["rows"]:
            if row["scheme"] != scheme:
                continue
            loss = torch.tensor(row["loss"])
            smooth = torch.nn.functional.avg_pool1d(loss[None, None], 10, 1, padding=0)[0, 0]
            axis.plot(range(9, 9 + smooth.numel()), smooth.tolist(), label=f"replay {row['replay']}")
        axis.set_title(scheme)
        axis.set_xlabel("step")
        axis.set_ylabel("training KL (10-step mean)")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
