"""MAEP with and without Fisher token weights against frequency and REAP, per layer, on one calibration set.

Run: python scripts/maep_token_weight.py [--model builtin:tiny-moe] [--out docs/maep_token_weight_results.json]

One prune per method and ratio (frequency, REAP, MAEP with ``token_weight`` none and fisher) on the same calibration
tokens, each a one-pass pipeline run (:func:`~moecompress.passes.prune_experts.prune_experts`). Every selection is
evaluated on held-out prose and code (perplexity and KL to the original), as docs/pruning.md reports.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from moecompress.checkpoint import resolve_model
from moecompress.evals.perplexity import evaluate
from moecompress.loading import quiet_transformers
from moecompress.passes.prune_experts import PruneExpertsConfig, prune_experts

METHODS = {
    "frequency": {"method": "frequency"},
    "reap": {"method": "reap"},
    "maep (unweighted)": {"method": "maep", "token_weight": "none"},
    "maep (fisher token weight)": {"method": "maep", "token_weight": "fisher"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-moe")
    parser.add_argument("--calib", default="builtin:prose,builtin:code")
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--ratios", default="0.25,0.5")
    parser.add_argument("--code-tokens", type=int, default=32768)
    parser.add_argument("--prose-tokens", type=int, default=None, help="default: all of builtin:prose:heldout")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    model_dir = resolve_model(args.model)
    base = {
        "prose": evaluate(model_dir, "builtin:prose:heldout", max_tokens=args.prose_tokens, progress=False),
        "code": evaluate(model_dir, "builtin:code:heldout", max_tokens=args.code_tokens, progress=False),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ratio in map(float, args.ratios.split(",")):
            for name, options in METHODS.items():
                out = Path(tmp) / f"{name}-{ratio}".replace(" ", "_")
                config = PruneExpertsConfig(ratio=ratio, **options)
                start = time.time()
                report = prune_experts(
                    model_dir, out, config, calib=args.calib, calib_tokens=args.calib_tokens, progress=False
                )
                seconds = time.time() - start
                prose = evaluate(
                    out, "builtin:prose:heldout", max_tokens=args.prose_tokens, reference_dir=model_dir, progress=False
                )
                code = evaluate(
                    out, "builtin:code:heldout", max_tokens=args.code_tokens, reference_dir=model_dir, progress=False
                )
                row = {
                    "method": name,
                    "ratio": ratio,
                    "prune_seconds": round(seconds, 1),
                    "prose_perplexity": prose.perplexity,
                    "code_perplexity": code.perplexity,
                    "prose_kl": prose.kl,
                    "code_kl": code.kl,
                    "removed": {layer: entry["removed"] for layer, entry in report["layers"].items()},
                }
                rows.append(row)
                print(
                    f"{ratio:.2f} {name:28s} prose {prose.perplexity:8.2f} code {code.perplexity:8.2f} "
                    f"kl {prose.kl:.4f}/{code.kl:.4f} removed {row['removed']}",
                    flush=True,
                )
    results = {
        "model": args.model,
        "calibration": report["calibration"],
        "eval_tokens": {"prose": base["prose"].tokens, "code": base["code"].tokens},
        "baseline": {"prose_perplexity": base["prose"].perplexity, "code_perplexity": base["code"].perplexity},
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
