"""Compare quantisation schemes and methods on builtin:tiny-moe: scheme × method → perplexity, routing
agreement, KL and effective bits per weight (every scale and zero point counted).

Run: python scripts/quant_table.py [--out docs/quantization_results.json] [--markdown docs/quantization_table.md]
Every number in docs/quantization.md comes from this script.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from table_io import quantization_baseline, quantization_parser, quantize_and_evaluate, run_facts, write_results

from moecompress.checkpoint import resolve_model
from moecompress.loading import quiet_transformers
from moecompress.passes.quantize import QuantizeConfig

SCHEMES = {
    "mxfp4": dict(scheme="mxfp4"),
    "mxfp4 (ceil scales)": dict(scheme="mxfp4", scale_rule="ceil"),
    "int4 g32 sym": dict(scheme="int4", group_size=32),
    "int4 g128 sym": dict(scheme="int4", group_size=128),
    "int4 g32 asym": dict(scheme="int4", group_size=32, symmetric=False),
    "int2 g32 asym": dict(scheme="int2", group_size=32),
    "int2 g128 asym": dict(scheme="int2", group_size=128),
    "w4a8 g32": dict(scheme="w4a8", group_size=32),
}


def main() -> None:
    parser = quantization_parser(__doc__.splitlines()[0], "docs/quantization_results.json")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--methods", default="rtn,gptq")
    args = parser.parse_args()
    torch.set_num_threads(2)
    quiet_transformers()

    model_dir = resolve_model(args.model)
    baseline = quantization_baseline(model_dir, args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.schemes.split(","):
            for method in args.methods.split(","):
                out = Path(tmp) / f"{len(rows)}"
                config = QuantizeConfig(method=method, **SCHEMES[name])
                report, result, second, seconds = quantize_and_evaluate(model_dir, out, config, args)
                footprint = report["footprint"]
                row = dict(
                    scheme=name,
                    method=method,
                    perplexity=result.perplexity,
                    second_perplexity=second.perplexity,
                    routing_agreement=result.routing_agreement,
                    kl=result.kl,
                    expert_bits=footprint["classes"]["experts"]["bits_per_weight"],
                    model_bits=footprint["total"]["bits_per_weight"],
                    bytes=footprint["file_bytes"],
                    rtn_fallback=sum(len(v) for v in report["rtn_fallback_experts"].values()),
                    quantize_seconds=seconds,
                )
                rows.append(row)
                print(
                    f"{name:20s} {method:4s} ppl {row['perplexity']:8.3f} code {row['second_perplexity']:8.3f} "
                    f"agree {row['routing_agreement']:.4f} kl {row['kl']:.4f} bits {row['expert_bits']:.3f}",
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
        "| scheme | method | prose perplexity | code perplexity | routing agreement | KL (nats/token) "
        "| expert bits/weight | model bits/weight | bytes |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| bf16 (original) | — | {base['perplexity']:.2f} | {base['second_perplexity']:.2f} | 1.0000 | 0 "
        f"| {base['expert_bits']:.3f} | {base['model_bits']:.3f} | {base['bytes']:,} |",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['scheme']} | {row['method']} | {row['perplexity']:.2f} | {row['second_perplexity']:.2f} | "
            f"{row['routing_agreement']:.4f} | {row['kl']:.4f} | {row['expert_bits']:.3f} | "
            f"{row['model_bits']:.3f} | {row['bytes']:,} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
