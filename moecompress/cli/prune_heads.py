"""``moecompress prune-heads``: remove whole KV groups (or query heads) chosen by learned binary gates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .common_options import (
    calib_option,
    calib_tokens_option,
    device_option,
    eval_options,
    out_option,
    overwrite_option,
    seq_len_option,
)
from .pass_options import PassCommand, config_from_options, config_options
from .run_options import run_one_pass_checked, run_options
from .trust_options import trust_options


@click.command("prune-heads", cls=PassCommand)
@trust_options
@run_options
@click.argument("model")
@out_option()
@config_options("prune_heads")
@calib_option("Calibration/training source(s), comma-separated (calibration part for built-ins).", old=("--data",))
@calib_tokens_option("Tokens of --calib (whole windows of --seq-len) the gates train and distil on.")
@seq_len_option()
@eval_options(
    "Evaluate against the input before and after distillation on this source (held-out part for built-ins).",
    "Skip the evaluation.",
)
@overwrite_option()
@device_option
def prune_heads_command(
    model: str,
    out_dir: Path,
    calib: str,
    calib_tokens: int,
    seq_len: int,
    eval_data: str,
    eval_tokens: int | None,
    no_eval: bool,
    overwrite: bool,
    resume: bool,
    quiet: bool,
    log_json: bool,
    **options: Any,
) -> None:
    """Prune MODEL's attention heads by --ratio and write the checkpoint to --out.

    The whole model is loaded. moecompress_report.json holds the chosen heads per layer, the gate trajectories,
    the KV-cache bytes per token before and after, and the evaluations. A killed run leaves its partial output
    hidden beside --out: --resume starts over (a whole-model pass keeps no partial state), --restart discards it;
    without either it is refused.
    """
    from ..checkpoint import resolve_model
    from ..loading import quiet_transformers
    from ..passes.prune_heads import PruneHeadsConfig

    quiet_transformers()
    config = config_from_options(PruneHeadsConfig, options)
    config.validate()
    model_dir = resolve_model(model)
    report, seconds = run_one_pass_checked(
        model_dir,
        out_dir,
        "prune_heads",
        config,
        overwrite=overwrite,
        resume=resume,
        calib=calib,
        calib_tokens=calib_tokens,
        seq_len=seq_len,
        eval_data=None if no_eval else eval_data,
        eval_tokens=None if no_eval else eval_tokens,
    )
    click.echo(
        f"removed {report['units_before'] - report['units_after']} of {report['units_before']} {config.unit}s "
        f"({config.method})"
    )
    for layer, info in report["layers"].items():
        click.echo(f"  layer {layer}: query heads {info['kept_query_heads']}, KV heads {info['kept_kv_heads']}")
    kv = report["kv_cache_bytes_per_token"]
    click.echo(f"KV cache {kv['before']} -> {kv['after']} bytes/token")
    click.echo(
        f"wrote {out_dir} in {seconds:.1f}s"
        + ("" if report["stock_loadable"] else "  (load after `import moecompress`)")
    )
    if "eval" in report:
        before, after = report["eval_before_distillation"], report["eval"]
        click.echo(
            f"perplexity {after['reference_perplexity']:.3f} -> {before['perplexity']:.3f} pruned -> "
            f"{after['perplexity']:.3f} distilled on {eval_data}; KL {after['kl']:.4f} nats/token"
        )
