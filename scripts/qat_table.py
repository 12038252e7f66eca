"""Routing-replay QAT on builtin:tiny-moe: PTQ (RTN + load-aware adapters) against QAT of the same adapters with
and without replayed routes, at equal steps, seed and adapter budget, for INT2 and MXFP4: held-out perplexity,
KL and routing agreement with the full-precision model, expert bits per weight, and the loss curves.

Run: python scripts/qat_table.py [--out docs/qat_results.json] [--markdown docs/qat_table.md] [--plot docs/qat_loss.png]
Every number in docs/qat.md comes from this script.
"""

from __future__ import annotations

import argparse
import itertools
import re
import tempfile
import time
from pathlib import Path

import torch
from table_io import run_facts, write_results

from moecompress.checkpoint import resolve_model
from moecompress.loading import quiet_transformers
from moecompress.passes.qat import QATConfig, qat_checkpoint
from moecompress.passes.quantize import QuantizeConfig
from moecompress.quantization.sensitivity import SENSITIVITIES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-moe")
    parser.add_argument("--data", default="builtin:prose", help="training and PTQ calibration source")
    parser.add_argument("--eval-data", default="builtin:prose:heldout")
    parser.add_argument("--schemes", default="int2,mxfp4")
    parser.add_argument(
        "--replays", default="all,none", help="comma-separated --replay schedules (layers:0,1 keeps its commas)"
    )
    parser.add_argument("--replay-weights", default="router")
    parser.add_argument("--budget", type=float, default=0.375, help="adapter bits per expert weight")
    parser.add_argument(
        "--sensitivity",
        choices=SENSITIVITIES,
        default=QuantizeConfig.sensitivity,
        help="the PTQ adapters' downstream sensitivity (docs/lowrank.md)",
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seeds", default="0", help="comma-separated seeds; each row is run once per seed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("docs/qat_results.json"))
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="PNG of the loss curves (needs matplotlib)")
    parser.add_argument("--oracle-only", action="store_true", help="only add the oracle-routing rows to --out")
    parser.add_argument("--merge", type=Path, nargs="+", help="combine these results files (same settings) into --out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    if args.oracle_only:
        oracle_only(args)
        return
    if args.merge:
        merge(args)
        return

    model_dir = resolve_model(args.model)
    rows, oracle = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for scheme, seed in itertools.product(args.schemes.split(","), [int(s) for s in args.seeds.split(",")]):
            quantize = QuantizeConfig(
                scheme=scheme, lowrank_budget=args.budget, sensitivity=args.sensitivity, seed=seed
            )
            oracle.append(oracle_routing(model_dir, Path(tmp) / "ptq", quantize, args))
            print(
                f"{scheme} seed {seed}: PTQ perplexity {oracle[-1]['free']:.3f} with its own routes, "
                f"{oracle[-1]['replayed']:.3f} with the full-precision model's",
                flush=True,
            )
            for replay in re.split(r",(?!\d)", args.replays):
                config = QATConfig(
                    quantize=quantize,
                    replay=replay,
                    replay_weights=args.replay_weights,
                    steps=args.steps,
                    lr=args.lr,
                    seed=seed,
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
                    seed=seed,
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
                    seconds=time.time() - start,
                )
                rows.append(row)
                write_all(args, rows, oracle)
                print(
                    f"{row['scheme']:28s} replay {row['replay']:10s} PTQ {row['ptq_perplexity']:.3f} -> QAT "
                    f"{row['perplexity']:.3f} (KL {row['ptq_kl']:.4f} -> {row['kl']:.4f}, agreement "
                    f"{row['ptq_routing_agreement']:.4f} -> {row['routing_agreement']:.4f}) {row['seconds']:.0f}s",
                    flush=True,
                )
    write_all(args, rows, oracle)


def write_all(args: argparse.Namespace, rows: list[dict], oracle: list[dict]) -> None:
    facts = run_facts(args)
    facts.update(
        steps=args.steps,
        lr=args.lr,
        seeds=args.seeds,
        budget=args.budget,
        sensitivity=args.sensitivity,
        replay_weights=args.replay_weights,
    )
    results = dict(**facts, rows=rows, oracle_routing=oracle)
    write_results(results, args.out, args.markdown, render_markdown)
    if args.plot:
        plot_losses(results, args.plot)


def merge(args: argparse.Namespace) -> None:
    """One results file from runs of this script split by scheme (e.g. run in parallel)."""
    import json

    parts = [json.loads(path.read_text()) for path in args.merge]
    settings = ("steps", "lr", "budget", "replay_weights", "model", "data")
    for part in parts[1:]:
        differing = [key for key in settings if part.get(key) != parts[0].get(key)]
        if differing:
            raise SystemExit(f"cannot merge runs whose {differing} differ")
    results = dict(parts[0])
    results["rows"] = [row for part in parts for row in part["rows"]]
    results["seeds"] = ",".join(str(seed) for seed in sorted({row["seed"] for row in results["rows"]}))
    results["oracle_routing"] = [entry for part in parts for entry in part.get("oracle_routing", [])]
    write_results(results, args.out, args.markdown, render_markdown)
    if args.plot:
        plot_losses(results, args.plot)


def oracle_only(args: argparse.Namespace) -> None:
    """Add the oracle-routing rows to an existing results file (``--out``) whose runs lack them."""
    import json

    results = json.loads(args.out.read_text())
    model_dir = resolve_model(args.model)
    oracle = []
    with tempfile.TemporaryDirectory() as tmp:
        for scheme, seed in dict.fromkeys((row["scheme"].split()[0], row["seed"]) for row in results["rows"]):
            quantize = QuantizeConfig(
                scheme=scheme,
                lowrank_budget=results["budget"],
                sensitivity=results.get("sensitivity", "none"),
                seed=seed,
            )
            oracle.append(oracle_routing(model_dir, Path(tmp) / "ptq", quantize, args))
            print(oracle[-1], flush=True)
    results["oracle_routing"] = oracle
    write_results(results, args.out, args.markdown, render_markdown)
    if args.plot:
        plot_losses(results, args.plot)


def oracle_routing(model_dir: Path, out: Path, quantize: QuantizeConfig, args: argparse.Namespace) -> dict:
    """Perplexity of the PTQ model (the QAT starting point: same config and seed) with its own routes, and with the
    full-precision model's routes replayed at evaluation: how much of the PTQ loss misrouting accounts for."""
    import math

    import torch.nn.functional as F

    from moecompress.calibration.batches import consecutive_windows, tokenize_documents
    from moecompress.calibration.sources import load_documents
    from moecompress.loading import load_adapter, load_model, load_tokenizer
    from moecompress.passes.quantize import quantize_checkpoint
    from moecompress.training.replay import RouteCapture, RouteReplay

    quantize_checkpoint(model_dir, out, quantize, calib=args.data, overwrite=True, progress=False)
    teacher_adapter, student_adapter = load_adapter(model_dir), load_adapter(out)
    teacher, student = load_model(model_dir, teacher_adapter), load_model(out, student_adapter)
    stream = tokenize_documents(load_documents(args.eval_data, default_part="heldout"), load_tokenizer(model_dir))
    windows = consecutive_windows(stream, 256)
    capture, replay = RouteCapture(teacher, teacher_adapter), RouteReplay(student, student_adapter, args.replay_weights)
    result = {"scheme": quantize.scheme, "seed": quantize.seed}
    for mode in ("free", "replayed"):
        replay.active = set(student_adapter.moe_layers()) if mode == "replayed" else set()
        nll, count = 0.0, 0
        with torch.inference_mode():
            for input_ids, _ in windows.batches(8):
                teacher(input_ids=input_ids, use_cache=False)
                replay.routes = capture.routes
                logits = student(input_ids=input_ids, use_cache=False).logits[:, :-1].float()
                nll -= F.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).sum().item()
                count += input_ids[:, 1:].numel()
        result[mode] = math.exp(nll / count)
    return result


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _cell(values: list[float], digits: int) -> str:
    """The mean over seeds, and each seed's value when there are several."""
    mean = f"{_mean(values):.{digits}f}"
    return mean if len(values) == 1 else f"{mean} ({', '.join(f'{v:.{digits}f}' for v in values)})"


def render_markdown(results: dict) -> str:
    rows = results["rows"]
    lines = [
        f"{results['steps']} steps, lr {results['lr']:g}, seeds {results['seeds']} (the mean, then each seed's value "
        f"where a row ran with several), adapters "
        f"{results['budget']:g} bits/expert weight spent by load; replayed weights: {results['replay_weights']}. "
        f"Full-precision perplexity {rows[0]['reference_perplexity']:.2f} ({rows[0]['tokens']:,} held-out tokens).",
        "",
        "| experts | expert bits/weight | method | perplexity | KL (nats/token) | routing agreement |",
        "|---|---|---|---|---|---|",
    ]
    for scheme in dict.fromkeys(row["scheme"] for row in rows):
        group = [row for row in rows if row["scheme"] == scheme]
        first_replay = group[0]["replay"]
        ptq = [row for row in group if row["replay"] == first_replay]
        bits = f"{group[0]['expert_bits']:.3f}"
        lines.append(
            f"| {scheme} | {bits} | PTQ (RTN + load-aware adapters) | {_cell([r['ptq_perplexity'] for r in ptq], 2)} "
            f"| {_cell([r['ptq_kl'] for r in ptq], 4)} | {_cell([r['ptq_routing_agreement'] for r in ptq], 4)} |"
        )
        for replay in dict.fromkeys(row["replay"] for row in group):
            runs = [row for row in group if row["replay"] == replay]
            lines.append(
                f"| {scheme} | {bits} | QAT, replay {replay} | {_cell([r['perplexity'] for r in runs], 2)} | "
                f"{_cell([r['kl'] for r in runs], 4)} | {_cell([r['routing_agreement'] for r in runs], 4)} |"
            )
    lines += [
        "",
        "PTQ perplexity with the model's own routes and with the full-precision model's routes replayed at evaluation:",
        "",
        "| experts | seed | own routes | full-precision routes |",
        "|---|---|---|---|",
    ]
    for entry in results["oracle_routing"]:
        lines.append(f"| {entry['scheme']} | {entry['seed']} | {entry['free']:.2f} | {entry['replayed']:.2f} |")
    return "\n".join(lines) + "\n"


def plot_losses(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schemes = list(dict.fromkeys(row["scheme"] for row in results["rows"]))
    figure, axes = plt.subplots(1, len(schemes), figsize=(5.5 * len(schemes), 4), squeeze=False)
    for axis, scheme in zip(axes[0], schemes, strict=True):
        group = [row for row in results["rows"] if row["scheme"] == scheme]
        for replay in dict.fromkeys(row["replay"] for row in group):
            loss = torch.tensor([row["loss"] for row in group if row["replay"] == replay]).mean(dim=0)
            smooth = torch.nn.functional.avg_pool1d(loss[None, None], 10, 1, padding=0)[0, 0]
            axis.plot(range(9, 9 + smooth.numel()), smooth.tolist(), label=f"replay {replay}")
        axis.set_title(scheme)
        axis.set_xlabel("step")
        axis.set_ylabel("training KL (10-step mean, mean over seeds)")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
