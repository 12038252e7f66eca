"""The binary scheme on builtin:tiny-moe: with and without salient weights, with the salient bitmap Golomb-coded,
Rice-coded or raw, RTN and GPTQ, and INT2 as the next step up: held-out perplexity, routing agreement, KL, and
effective bits per expert weight (every scale, bitmap byte and salient value counted), with what the raw bitmap
would have cost.

Run: python scripts/binary_table.py [--out docs/binary_results.json] [--markdown docs/binary_table.md]
Every number in docs/binary.md comes from this script.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
from table_io import quantization_baseline, quantization_parser, quantize_and_evaluate, run_facts, write_results

from moecompress.checkpoint import resolve_model
from moecompress.loading import quiet_transformers
from moecompress.passes.quantize import QuantizeConfig

ROWS = {
    "binary g128": dict(scheme="binary"),
    "binary g128 + 1% salient, golomb": dict(scheme="binary", salient_fraction=0.01, bitmap="golomb"),
    "binary g128 + 1% salient, rice": dict(scheme="binary", salient_fraction=0.01, bitmap="rice"),
    "binary g128 + 1% salient, raw bitmap": dict(scheme="binary", salient_fraction=0.01, bitmap="raw"),
    "binary g128 + 3% salient, golomb": dict(scheme="binary", salient_fraction=0.03, bitmap="golomb"),
    "binary g64 + 1% salient, golomb": dict(scheme="binary", group_size=64, salient_fraction=0.01),
    "int2 g128 asym": dict(scheme="int2", group_size=128),
    "int2 g128 asym + 1% salient, golomb": dict(scheme="int2", group_size=128, salient_fraction=0.01),
}
DEFAULT_RUNS = ";".join(
    [
        "binary g128:rtn",
        "binary g128:gptq",
        "binary g128 + 1% salient, golomb:rtn",
        "binary g128 + 1% salient, rice:rtn",
        "binary g128 + 1% salient, raw bitmap:rtn",
        "binary g128 + 1% salient, golomb:gptq",
        "binary g128 + 3% salient, golomb:gptq",
        "binary g64 + 1% salient, golomb:gptq",
        "int2 g128 asym:gptq",
        "int2 g128 asym + 1% salient, golomb:gptq",
    ]
)


def _entropy_bits(p: float) -> float:
    return 0.0 if p in (0, 1) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def main() -> None:
    parser = quantization_parser(__doc__.splitlines()[0], "docs/binary_results.json")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="name:method pairs, separated by ';'")
    args = parser.parse_args()
    torch.set_num_threads(2)
    quiet_transformers()

    model_dir = resolve_model(args.model)
    baseline = quantization_baseline(model_dir, args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in args.runs.split(";"):
            name, _, method = run.rpartition(":")
            out = Path(tmp) / f"{len(rows)}"
            config = QuantizeConfig(method=method, **ROWS[name])
            report, result, second, seconds = quantize_and_evaluate(model_dir, out, config, args)
            experts = report["footprint"]["classes"]["experts"]
            fraction = config.salient_fraction
            row = dict(
                name=name,
                method=method,
                perplexity=result.perplexity,
                second_perplexity=second.perplexity,
                routing_agreement=result.routing_agreement,
                kl=result.kl,
                expert_bits=experts["bits_per_weight"],
                expert_bits_raw_bitmap=experts.get("bits_per_weight_raw_bitmap", experts["bits_per_weight"]),
                bitmap_bytes=experts.get("bitmap_bytes", 0),
                bitmap_raw_bytes=experts.get("bitmap_raw_bytes", 0),
                salient_value_bytes=experts.get("salient_value_bytes", 0),
                bitmap_bits_per_position=8 * experts.get("bitmap_bytes", 0) / experts["weights"],
                entropy_bits_per_position=_entropy_bits(fraction),
                model_bits=report["footprint"]["total"]["bits_per_weight"],
                bytes=report["footprint"]["file_bytes"],
                quantize_seconds=seconds,
            )
            rows.append(row)
            print(
                f"{name:40s} {method:4s} ppl {row['perplexity']:9.3f} code {row['second_perplexity']:9.3f} "
                f"agree {row['routing_agreement']:.4f} kl {row['kl']:.4f} bits {row['expert_bits']:.3f} "
                f"(raw bitmap {row['expert_bits_raw_bitmap']:.3f})",
                flush=True,
            )
    results = dict(
        **run_facts(args),
        baseline=baseline,
        rows=rows,
    )
    write_results(results, args.out, args.markdown, render_markdown)


def render_markdown(results: dict) -> str:
    base = results["baseline"]
    lines = [
        "| scheme | method | prose ppl | code ppl | routing agreement | KL | expert bits/weight "
        "| … with a raw bitmap | bitmap bits/position (H(p)) | bitmap bytes coded / raw | salient value bytes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| bf16 (original) | — | {base['perplexity']:.2f} | {base['second_perplexity']:.2f} | 1.0000 | 0 "
        f"| {base['expert_bits']:.3f} | — | — | — | — |",
    ]
    for row in results["rows"]:
        salient = row["bitmap_raw_bytes"] > 0
        bitmap = f"{row['bitmap_bits_per_position']:.4f} ({row['entropy_bits_per_position']:.4f})" if salient else "—"
        sizes = f"{row['bitmap_bytes']:,} / {row['bitmap_raw_bytes']:,}" if salient else "—"
        values = f"{row['salient_value_bytes']:,}" if salient else "—"
        lines.append(
            f"| {row['name']} | {row['method']} | {row['perplexity']:.2f} | {row['second_perplexity']:.2f} | "
            f"{row['routing_agreement']:.4f} | {row['kl']:.4f} | {row['expert_bits']:.3f} | "
            f"{row['expert_bits_raw_bitmap']:.3f} | {bitmap} | {sizes} | {values} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
