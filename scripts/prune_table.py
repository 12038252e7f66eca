"""Compare expert pruning and merging on one model: method × router refit × ratio × scope → held-out prose and code
perplexity, KL to the original, routing agreement, multiple-choice accuracy, bytes, seconds.

Run:  python scripts/prune_table.py --model builtin:tiny-moe
      (writes docs/pruning_results_tiny-moe.json and docs/pruning_table_tiny-moe.md, after every row)
      python scripts/prune_table.py --summary docs/pruning_results_*.json --markdown docs/pruning_summary.md

Every number in docs/pruning.md comes from this script. The original model is run once: its logits and routes on
the evaluation windows are kept, and every pruned model is compared against them, loaded whole once for all its
figures. The multiple-choice check is :mod:`moecompress.evals.choice` on the held-out prose and code.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from table_io import run_facts, write_results

# expert_merge, router_refit and the pipeline are imported now, not when the first row needs them: a long run then
# uses one state of the code while others edit the working tree.
import moecompress.passes.expert_merge
import moecompress.passes.prune_experts as prune_module
import moecompress.passes.router_refit
import moecompress.runner.pipeline  # noqa: F401
from moecompress.calibration.batches import TokenWindows, consecutive_windows, sampled_windows, tokenize_documents
from moecompress.calibration.sources import load_documents
from moecompress.checkpoint import CheckpointReader, resolve_model
from moecompress.errors import UserInputError
from moecompress.evals.choice import ChoiceItems, build_items, evaluate_items
from moecompress.evals.perplexity import EvalTotals, batch_sums, windows_per_forward
from moecompress.evals.routing import RouteRecorder, routing_agreement
from moecompress.loading import load_adapter, load_model, load_tokenizer, quiet_transformers
from moecompress.passes.prune_experts import PruneExpertsConfig, prune_experts

METHODS = ("frequency", "reap", "maep", "merge")
DOMAINS = {"prose": "builtin:prose:heldout", "code": "builtin:code:heldout"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-moe", help="builtin:tiny-moe or a model directory")
    parser.add_argument("--name", default=None, help="the name in the output files (default: the model's)")
    parser.add_argument("--calib", default="builtin:prose,builtin:code")
    parser.add_argument("--calib-tokens", type=int, default=8192)
    parser.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens per domain (prose, code)")
    parser.add_argument("--choice-items", type=int, default=256, help="multiple-choice items per domain")
    parser.add_argument("--choice-context", type=int, default=64)
    parser.add_argument("--choice-length", type=int, default=16)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--refit", default="off,on", help="router recalibration: off, on or both")
    parser.add_argument("--ratios", default="0.25,0.5")
    parser.add_argument("--scopes", default="layer,global")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="default docs/pruning_results_NAME.json")
    parser.add_argument("--markdown", type=Path, default=None, help="default docs/pruning_table_NAME.md")
    parser.add_argument("--resume", action="store_true", help="keep the rows --out already holds")
    parser.add_argument("--summary", type=Path, nargs="+", default=None, help="summarise these results files")
    args = parser.parse_args()
    if args.summary:
        write_summary(args.summary, args.markdown or Path("docs/pruning_summary.md"))
        return
    torch.set_num_threads(args.threads)
    quiet_transformers()
    model_dir = resolve_model(args.model)
    name = args.name or (args.model.split(":", 1)[1] if args.model.startswith("builtin:") else model_dir.name)
    out = args.out or Path(f"docs/pruning_results_{name}.json")
    markdown = args.markdown or Path(f"docs/pruning_table_{name}.md")
    run_table(args, model_dir, name, out, markdown)


def tokenize_once() -> dict[str, float]:
    """Keep the calibration stream a prune run tokenises, keyed by the documents' texts and the tokenizer.

    ``prune_experts`` tokenises its whole calibration source on every call (1.4M tokens for builtin:code's
    calibration part); the table prunes one model 32 times from one source, so the script tokenises it once and
    the runs draw their windows from the same tokens. Returns where the first tokenisation's seconds are recorded.
    """
    cache: dict[tuple, Any] = {}
    seconds: dict[str, float] = {}

    def cached(documents, tokenizer):
        digest = hashlib.sha256()
        for doc in documents:
            digest.update(doc.tag.encode() + b"\0" + doc.text.encode() + b"\0")
        key = (str(tokenizer.name_or_path), digest.hexdigest())
        if key not in cache:
            start = time.time()
            cache[key] = tokenize_documents(documents, tokenizer)
            seconds.setdefault("calibration_tokenize_seconds", time.time() - start)
        return cache[key]

    prune_module.tokenize_documents = cached
    return seconds


class Reference:
    """The original model's logits and routes on each domain's evaluation windows."""

    def __init__(self, model_dir: Path, windows: dict[str, TokenWindows]):
        self.windows = windows
        adapter = load_adapter(model_dir)
        model = load_model(model_dir, adapter)
        self.batch = windows_per_forward(next(iter(windows.values())).input_ids.shape[1], 1)
        self.logits: dict[str, list[torch.Tensor]] = {}
        self.routes: dict[str, list[dict[int, torch.Tensor]]] = {}
        recorder = RouteRecorder(model, adapter)
        with torch.inference_mode():
            for domain, win in windows.items():
                self.logits[domain], self.routes[domain] = [], []
                for ids, _ in win.batches(self.batch):
                    self.logits[domain].append(model(input_ids=ids, use_cache=False).logits.float())
                    self.routes[domain].append(dict(recorder.routes))
        recorder.remove()

    def compare(self, model_dir: Path, merged: dict[int, list[list[int]]]) -> dict[str, dict[str, float | None]]:
        """Per domain: perplexity, KL(original ‖ model) per token, and routing agreement: the share of the original's
        top-k routes whose expert, or the expert it was merged into (``merged``: per layer, groups of original ids,
        the merged expert's id first), is among the model's top-k."""
        into = {}
        for layer, groups in merged.items():
            into[layer] = torch.arange(1 + max(e for group in groups for e in group))
            for group in groups:
                into[layer][group] = group[0]
        adapter = load_adapter(model_dir)
        model = load_model(model_dir, adapter)
        recorder = RouteRecorder(model, adapter)
        figures = {}
        with torch.inference_mode():
            for domain, win in self.windows.items():
                totals = EvalTotals()
                batches = zip(win.batches(self.batch), self.logits[domain], self.routes[domain], strict=True)
                for (ids, _), ref_logits, ref_routes in batches:
                    totals.add(batch_sums(ids, model(input_ids=ids, use_cache=False).logits, ref_logits))
                    ref_routes = {
                        layer: into[layer][route.clamp(min=0)].where(route >= 0, route) if layer in into else route
                        for layer, route in ref_routes.items()
                    }
                    totals.add_agreement(*routing_agreement(ref_routes, recorder.routes))
                result = totals.result(win, with_reference=True)
                figures[domain] = dict(
                    perplexity=result.perplexity, kl=result.kl, routing_agreement=result.routing_agreement
                )
        recorder.remove()
        return figures


def run_table(args: argparse.Namespace, model_dir: Path, name: str, out: Path, markdown: Path) -> None:
    setup_start = time.time()
    timings = tokenize_once()
    tokenizer = load_tokenizer(model_dir)
    streams = {d: tokenize_documents(load_documents(s, default_part="heldout"), tokenizer) for d, s in DOMAINS.items()}
    windows = {d: consecutive_windows(stream, 256, args.eval_tokens) for d, stream in streams.items()}
    items: dict[str, ChoiceItems] = {
        d: build_items(
            stream.ids,
            context=args.choice_context,
            length=args.choice_length,
            items=args.choice_items,
        )
        for d, stream in streams.items()
    }
    reference = Reference(model_dir, windows)
    base_choice = dict(zip(items, evaluate_items(model_dir, list(items.values())), strict=True))
    with CheckpointReader(model_dir) as reader:
        base_bytes = reader.total_bytes()
    adapter = load_adapter(model_dir)
    calib_stream = prune_module.tokenize_documents(load_documents(args.calib, default_part="calib"), tokenizer)
    calib_windows = sampled_windows(calib_stream, 256, args.calib_tokens, seed=0)
    calib_share = {
        tag: int((calib_windows.tags == i).sum()) for i, tag in enumerate(calib_windows.tag_names)
    }  # what the default seed draws from each calibration source
    results: dict[str, Any] = dict(
        **run_facts(args),
        name=name,
        eval_tokens={d: w.input_ids.shape[0] * (w.input_ids.shape[1] - 1) for d, w in windows.items()},
        choice=dict(items=args.choice_items, context=args.choice_context, length=args.choice_length, distractors=3),
        calibration_tokens_by_source=calib_share,
        baseline=dict(
            **{f"{d}_perplexity": reference_perplexity(reference, d) for d in DOMAINS},
            **{f"{d}_choice_accuracy": r.accuracy for d, r in base_choice.items()},
            **{f"{d}_choice_margin": r.margin for d, r in base_choice.items()},
            bytes=base_bytes,
            experts_per_layer=[adapter.experts_in_layer(layer) for layer in adapter.moe_layers()],
            top_k=adapter.top_k,
        ),
        rows=[],
    )
    if args.resume and out.is_file():
        results["rows"] = json.loads(out.read_text())["rows"]
    done = {row_key(row) for row in results["rows"]}
    results["setup_seconds"] = time.time() - setup_start
    results.update(timings)
    print(f"{name}: setup {results['setup_seconds']:.1f} s, calibration tokens {calib_share}", flush=True)
    version = code_version()
    refits = {"off": [False], "on": [True], "off,on": [False, True], "on,off": [False, True]}[args.refit]
    with tempfile.TemporaryDirectory(prefix=f"prune_table_{name}_") as scratch:
        tmp = Path(scratch)
        for ratio in map(float, args.ratios.split(",")):
            for scope in args.scopes.split(","):
                for method in args.methods.split(","):
                    for refit in refits:
                        row = dict(method=method, recalibrate_router=refit, ratio=ratio, scope=scope)
                        if row_key(row) in done:
                            continue
                        row.update(measure_row(model_dir, tmp / f"{len(results['rows'])}", row, reference, items, args))
                        row["code"] = version
                        results["rows"].append(row)
                        results["rows"].sort(key=row_order)
                        print(row_line(row), flush=True)
                        write_results(results, out, markdown, render_markdown)
    write_results(results, out, markdown, render_markdown)


def reference_perplexity(reference: Reference, domain: str) -> float:
    totals = EvalTotals()
    for (ids, _), logits in zip(
        reference.windows[domain].batches(reference.batch), reference.logits[domain], strict=True
    ):
        totals.add(batch_sums(ids, logits))
    return totals.result(reference.windows[domain], with_reference=False).perplexity


def row_key(row: dict) -> tuple:
    return (row["method"], row["recalibrate_router"], row["ratio"], row["scope"])


def row_order(row: dict) -> tuple:
    method = METHODS.index(row["method"]) if row["method"] in METHODS else len(METHODS)
    return (row["ratio"], row["scope"] != "layer", method, row["method"], row["recalibrate_router"])


def code_version() -> str:
    """The commit the package was run at, ``+modified`` where its files differ from it (a shared working tree)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+modified" if git("status", "--porcelain", "moecompress") else "")


def measure_row(
    model_dir: Path, out: Path, row: dict, reference: Reference, items: dict[str, ChoiceItems], args
) -> dict[str, Any]:
    config = PruneExpertsConfig(
        method=row["method"], ratio=row["ratio"], scope=row["scope"], recalibrate_router=row["recalibrate_router"]
    )
    start = time.time()
    try:
        report = prune_experts(model_dir, out, config, calib=args.calib, calib_tokens=args.calib_tokens, progress=False)
    except UserInputError as error:
        return dict(refused=str(error))
    seconds = time.time() - start
    merged = {int(layer): entry["merged"] for layer, entry in report["layers"].items() if "merged" in entry}
    figures = reference.compare(out, merged)
    choice = dict(zip(items, evaluate_items(out, list(items.values())), strict=True))
    adapter = load_adapter(out)
    with CheckpointReader(out) as reader:
        size = reader.total_bytes()
    measured: dict[str, Any] = {}
    for domain, values in figures.items():
        measured.update({f"{domain}_{key}": value for key, value in values.items()})
    for domain, result in choice.items():
        measured[f"{domain}_choice_accuracy"] = result.accuracy
        measured[f"{domain}_choice_margin"] = result.margin
    measured.update(
        bytes=size,
        experts_per_layer=[adapter.experts_in_layer(layer) for layer in adapter.moe_layers()],
        prune_seconds=seconds,
        row_seconds=time.time() - start,
    )
    return measured


def row_line(row: dict) -> str:
    head = (
        f"{row['method']:9s} refit {'on ' if row['recalibrate_router'] else 'off'} {row['ratio']:.2f} {row['scope']:6s}"
    )
    if "refused" in row:
        return f"{head} refused: {row['refused']}"
    return (
        f"{head} prose {row['prose_perplexity']:8.2f} code {row['code_perplexity']:8.2f} "
        f"kl {row['prose_kl']:.3f}/{row['code_kl']:.3f} mc {row['prose_choice_accuracy']:.3f}/"
        f"{row['code_choice_accuracy']:.3f} prune {row['prune_seconds']:.1f} s row {row['row_seconds']:.1f} s"
    )


def _agreement(row: dict) -> str:
    values = [row.get(f"{d}_routing_agreement") for d in DOMAINS]
    return "—" if None in values else " / ".join(f"{v:.3f}" for v in values)


def render_markdown(results: dict) -> str:
    base = results["baseline"]
    lines = [
        "| method | router refit | removed | scope | prose ppl | code ppl | KL prose / code | routing agreement "
        "prose / code | choice acc. prose / code | experts per layer | bytes | prune s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| none (original) | — | 0% | — | {base['prose_perplexity']:.2f} | {base['code_perplexity']:.2f} | 0 / 0 "
        f"| 1 / 1 | {base['prose_choice_accuracy']:.3f} / {base['code_choice_accuracy']:.3f} "
        f"| {', '.join(map(str, base['experts_per_layer']))} | {base['bytes']:,} | — |",
    ]
    for row in results["rows"]:
        head = (
            f"| {row['method']} | {'yes' if row['recalibrate_router'] else 'no'} | {row['ratio']:.0%} | {row['scope']}"
        )
        if "refused" in row:
            lines.append(f"{head} | refused: {row['refused']} |" + " |" * 7)
            continue
        lines.append(
            f"{head} | {row['prose_perplexity']:.2f} | {row['code_perplexity']:.2f} | {row['prose_kl']:.3f} / "
            f"{row['code_kl']:.3f} | {_agreement(row)} | {row['prose_choice_accuracy']:.3f} / "
            f"{row['code_choice_accuracy']:.3f} | {', '.join(map(str, row['experts_per_layer']))} | "
            f"{row['bytes']:,} | {row['prune_seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


SUMMARY_FIGURES = (
    ("prose_perplexity", "prose ppl", min),
    ("code_perplexity", "code ppl", min),
    ("prose_choice_accuracy", "choice accuracy prose", max),
    ("code_choice_accuracy", "choice accuracy code", max),
)


def label(row: dict) -> str:
    return row["method"] + (" + refit" if row["recalibrate_router"] else "")


def write_summary(paths: list[Path], markdown: Path) -> None:
    """Per model, ratio and scope, for each figure: REAP (no refit) against the best other row; then the best
    removal (frequency, REAP, MAEP) against the best merge, which shows where they trade places by task."""
    titles = " | ".join(title for _, title, _ in SUMMARY_FIGURES)
    against_reap = [f"| model | removed | scope | {titles} |", "|---|---|---|" + "---|" * len(SUMMARY_FIGURES)]
    removal_merge = list(against_reap)
    for path in paths:
        results = json.loads(path.read_text())
        rows = [row for row in results["rows"] if "refused" not in row]
        for ratio in sorted({row["ratio"] for row in rows}):
            for scope in ("layer", "global"):
                group = [row for row in rows if row["ratio"] == ratio and row["scope"] == scope]
                reap = next((row for row in group if row["method"] == "reap" and not row["recalibrate_router"]), None)
                removals = [row for row in group if row["method"] != "merge"]
                merges = [row for row in group if row["method"] == "merge"]
                if reap is None or not merges:
                    continue
                head = f"| {results['name']} | {ratio:.0%} | {scope} | "
                reap_cells, versus_cells = [], []
                for key, _, pick in SUMMARY_FIGURES:
                    best = pick([row for row in group if row is not reap], key=lambda row, key=key: row[key])
                    reap_cells.append(f"{_figure(reap, key)} → {_figure(best, key)} ({label(best)})")
                    removal = pick(removals, key=lambda row, key=key: row[key])
                    merge = pick(merges, key=lambda row, key=key: row[key])
                    cells = [f"{_figure(row, key)} ({label(row)})" for row in (removal, merge)]
                    if removal[key] != merge[key]:
                        won = (removal, merge).index(pick((removal, merge), key=lambda row, key=key: row[key]))
                        cells[won] = f"**{cells[won]}**"
                    versus_cells.append(" vs ".join(cells))
                against_reap.append(head + " | ".join(reap_cells) + " |")
                removal_merge.append(head + " | ".join(versus_cells) + " |")
    markdown.write_text(
        "REAP (no router refit) → the best other row:\n\n"
        + "\n".join(against_reap)
        + "\n\nBest removal (frequency, REAP, MAEP; with or without refit) vs best merge "
        + "(the better in bold, neither where equal):\n\n"
        + "\n".join(removal_merge)
        + "\n"
    )


def _figure(row: dict, key: str) -> str:
    return f"{row[key]:.3f}" if "choice" in key else f"{row[key]:.2f}"


if __name__ == "__main__":
    main()
