"""What every results script records beside its rows, and how it writes them (JSON, optional markdown)."""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_RUN_ARGS = ("model", "calib", "calib_tokens", "data", "second_data")


def quantization_parser(description: str, out: str) -> argparse.ArgumentParser:
    """The model, calibration, evaluation and output options the quantisation tables share."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="builtin:tiny-moe")
    parser.add_argument("--calib", default="builtin:prose")
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--data", default="builtin:prose:heldout")
    parser.add_argument("--second-data", default="builtin:code:heldout")
    parser.add_argument("--second-tokens", type=int, default=32768)
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument("--markdown", type=Path, default=None)
    return parser


def run_facts(args: argparse.Namespace) -> dict[str, Any]:
    """Date, machine, torch version, and the model and data arguments the script was given."""
    facts: dict[str, Any] = dict(
        date=time.strftime("%Y-%m-%d"),
        machine=f"{platform.machine()}, {torch.get_num_threads()} threads, CPU",
        torch=torch.__version__,
    )
    facts.update({name: getattr(args, name) for name in _RUN_ARGS if hasattr(args, name)})
    return facts


def write_results(
    results: dict[str, Any], out: Path, markdown: Path | None, render: Callable[[dict[str, Any]], str]
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    if markdown:
        markdown.write_text(render(results))


def quantize_and_evaluate(model_dir: Path, out: Path, config: Any, args: argparse.Namespace) -> tuple:
    """Quantise ``model_dir`` into ``out`` with ``config`` and evaluate it on both data sets:
    ``(report, result on --data against the original, result on --second-data, quantisation seconds)``."""
    from moecompress.evals.perplexity import evaluate
    from moecompress.passes.quantize import quantize_checkpoint

    start = time.time()
    report = quantize_checkpoint(
        model_dir, out, config, calib=args.calib, calib_tokens=args.calib_tokens, progress=False
    )
    seconds = time.time() - start
    result = evaluate(out, args.data, reference_dir=model_dir, progress=False)
    second = evaluate(out, args.second_data, max_tokens=args.second_tokens, progress=False)
    return report, result, second, seconds


def quantization_baseline(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The unquantised model on both data sets, and its footprint: the tables' first row."""
    from moecompress.evals.footprint import checkpoint_footprint
    from moecompress.evals.perplexity import evaluate

    base = evaluate(model_dir, args.data, progress=False)
    second = evaluate(model_dir, args.second_data, max_tokens=args.second_tokens, progress=False)
    footprint = checkpoint_footprint(model_dir).to_json()
    return dict(
        perplexity=base.perplexity,
        second_perplexity=second.perplexity,
        expert_bits=footprint["classes"]["experts"]["bits_per_weight"],
        model_bits=footprint["total"]["bits_per_weight"],
        bytes=footprint["file_bytes"],
        tokens=base.tokens,
    )
