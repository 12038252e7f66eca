"""A recipe run as one layer pipeline against the same passes chained through intermediate checkpoints.

Each variant runs in its own process (so that /proc/self/io counts its bytes alone) on the recipe's model:
- ``pipeline``: ``moecompress run`` as it is (shared sweeps, sequential calibration, the output written once);
- ``chained``: ``run_recipe(..., chained=True)``, every pass a checkpoint-to-checkpoint job as before the pipeline;
- ``pipeline-nonsequential``: the pipeline with its rewriting sweep's replacement switched off, so every layer is
  calibrated on the original model's hidden states (isolates what sequential calibration does);
- ``pipeline-with-adapters``: the pipeline whose recomputed outputs include the low-rank adapters (the pipeline
  leaves them out, as the one-pass GPTQ quantise does).

Reported per variant and calibration seed: held-out perplexity, KL to the input and routing agreement (the recipe's
evaluation), the output's bytes, bytes read and written by the process (``rchar``/``wchar``: every read and write
call, the evaluation's included), and wall time.

    python scripts/pipeline_table.py --recipe recipes/default.yaml --seeds 0 1 \\
        --json docs/pipeline_results.json --table docs/pipeline_table.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("pipeline", "chained", "pipeline-nonsequential", "pipeline-with-adapters")


def _io() -> dict[str, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read": int(fields["rchar"]), "written": int(fields["wchar"])}


def _with_adapters(block):
    """A block's weights as the loaded model computes them: dequantised plus each adapter's ``L·R``."""
    from dataclasses import replace

    from moecompress.passes.base import block_weights
    from moecompress.quantization.formats.native import ADAPTER_DTYPE

    weights = block_weights(block)
    adapters = getattr(block, "adapters", None)
    if not adapters:
        return weights
    gate_up, down, inter = weights.gate_up.clone(), weights.down.clone(), weights.intermediate_size
    for (expert, which), (left, right) in adapters.items():
        delta = left.to(ADAPTER_DTYPE).float() @ right.to(ADAPTER_DTYPE).float()
        target = {"gate": gate_up[expert, :inter], "up": gate_up[expert, inter:], "down": down[expert]}[which]
        target += delta
    return replace(weights, gate_up=gate_up, down=down)


def _child(recipe_path: Path, variant: str, seed: int, out: Path) -> None:
    import dataclasses

    from moecompress.checkpoint import resolve_model
    from moecompress.runner import pipeline
    from moecompress.runner.recipes import load_recipe, run_recipe

    recipe = load_recipe(recipe_path)
    recipe.calibration = dataclasses.replace(recipe.calibration, seed=seed)
    recipe.passes = [
        (name, dataclasses.replace(config, seed=seed) if hasattr(config, "seed") else config)
        for name, config in recipe.passes
    ]
    if variant == "pipeline-nonsequential":
        plan = pipeline.plan_sweeps
        pipeline.plan_sweeps = lambda passes: dataclasses.replace(plan(passes), sequential=False)
    if variant == "pipeline-with-adapters":
        pipeline.block_weights = _with_adapters
    before, started = _io(), time.monotonic()
    report = run_recipe(recipe, resolve_model(recipe.model), out, progress=False, chained=variant == "chained")
    seconds, after = time.monotonic() - started, _io()
    output_bytes = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    evaluation = report["eval"]
    print(
        json.dumps(
            {
                "variant": variant,
                "seed": seed,
                "perplexity": evaluation["perplexity"],
                "reference_perplexity": evaluation["reference_perplexity"],
                "kl": evaluation["kl"],
                "routing_agreement": evaluation["routing_agreement"],
                "eval_tokens": evaluation["tokens"],
                "calib_tokens": recipe.calibration.tokens,
                "output_bytes": output_bytes,
                "bytes_read": after["read"] - before["read"],
                "bytes_written": after["written"] - before["written"],
                "seconds": round(seconds, 1),
            }
        )
    )


def _table(rows: list[dict]) -> str:
    lines = [
        "| variant | seed | perplexity | KL (nats/token) | routing agreement | output bytes | bytes read | "
        "bytes written | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['variant']} | {row['seed']} | {row['perplexity']:.4f} | {row['kl']:.5f} | "
            f"{row['routing_agreement']:.4f} | {row['output_bytes']:,} | {row['bytes_read']:,} | "
            f"{row['bytes_written']:,} | {row['seconds']} |"
        )
    reference = rows[0]["reference_perplexity"]
    tokens = f"{rows[0]['calib_tokens']} calibration tokens, {rows[0]['eval_tokens']} held-out evaluation tokens"
    return "\n".join([*lines, "", f"Input perplexity {reference:.4f}; {tokens}."]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=Path("recipes/default.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--table", type=Path, default=None)
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "SEED", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, seed, out = args.child
        _child(args.recipe, variant, int(seed), Path(out))
        return
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            for variant in args.variants:
                out = Path(scratch) / f"{variant}-{seed}"
                command = [sys.executable, __file__, "--recipe", str(args.recipe), "--child", variant, str(seed), out]
                result = subprocess.run(
                    [str(part) for part in command], capture_output=True, text=True, env={**os.environ}
                )
                if result.returncode:
                    sys.exit(f"{variant} seed {seed} failed:\n{result.stderr[-3000:]}")
                rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    table = _table(rows)
    if args.table:
        args.table.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
