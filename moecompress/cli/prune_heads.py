"""``moecompress prune-heads``: remove whole KV groups (or query heads) chosen by learned binary gates."""

from __future__ import annotations

import time
from pathlib import Path

import click

from .common_options import (
    calib_option,
    calib_tokens_option,
    chosen_device,
    device_option,
    eval_options,
    seq_len_option,
)
from .run_options import check_one_pass_before_work, run_options
from .trust_options import trust_options


@click.command("prune-heads")
@trust_options
@run_options
@click.argument("model")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Output directory (written atomically; must not exist unless --overwrite).",
)
@click.option(
    "--ratio",
    type=float,
    required=True,
    help="Fraction of the units to remove, in (0, 1): of each layer's KV groups (or query heads), or of all KV "
    "groups with --scope global. Must leave every layer at least one.",
)
@click.option(
    "--unit",
    type=click.Choice(["kv-group", "query-head"]),
    default="kv-group",
    show_default=True,
    help="kv-group: a gate per KV head and the query heads that read it (shrinks the KV cache); query-head: a "
    "gate per query head, the same number removed from every KV group (KV cache unchanged).",
)
@click.option(
    "--method",
    type=click.Choice(["learned", "magnitude", "random"]),
    default="learned",
    show_default=True,
    help="learned: binary gates trained on the frozen model under a Lagrangian sparsity objective; magnitude: "
    "the Frobenius norm of each unit's q/k/v/o weights; random: seeded random choice (baselines).",
)
@click.option(
    "--scope",
    type=click.Choice(["layer", "global"]),
    default="layer",
    show_default=True,
    help="layer: the same number from every layer (loads in stock transformers); global: KV groups ranked over "
    "all layers, counts differ per layer (loads after `import moecompress`).",
)
@click.option("--steps", type=click.IntRange(min=0), default=200, show_default=True, help="Gate-training steps.")
@click.option(
    "--distill-steps",
    type=click.IntRange(min=0),
    default=100,
    show_default=True,
    help="Steps of distillation (KL to the original's logits) of the pruned model's attention and norms; 0 skips.",
)
@click.option(
    "--lr",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Gate learning rate (plain SGD on the gate logits).",
)
@click.option(
    "--distill-lr",
    type=click.FloatRange(min=0, min_open=True),
    default=3e-4,
    show_default=True,
    help="Distillation learning rate.",
)
@click.option(
    "--noise-bias",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Shift of the gates' logistic sampling noise toward closing at the start of training, decaying linearly "
    "to 0 over the warm-up (the first half of --steps). 0 (default) disables it: on tiny-moe 2.0 tied at 25% "
    "and hurt at 50% (docs/heads.md).",
)
@click.option(
    "--gate-objective",
    type=click.Choice(["lm", "kl"]),
    default="lm",
    show_default=True,
    help="What the gates minimise: lm (next-token cross-entropy) or kl (KL to the original model's logits).",
)
@calib_option("Calibration/training source(s), comma-separated (calibration part for built-ins).", old=("--data",))
@calib_tokens_option("Tokens of --calib (whole windows of --seq-len) the gates train and distil on.")
@seq_len_option()
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Windows per step.")
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed for windows, gate noise and --method random."
)
@eval_options(
    "Evaluate against the input before and after distillation on this source (held-out part for built-ins).",
    "Skip the evaluation.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@device_option
def prune_heads_command(
    model: str,
    out_dir: Path,
    ratio: float,
    unit: str,
    method: str,
    scope: str,
    steps: int,
    distill_steps: int,
    lr: float,
    distill_lr: float,
    noise_bias: float,
    gate_objective: str,
    calib: str,
    calib_tokens: int,
    seq_len: int,
    batch_size: int,
    seed: int,
    eval_data: str,
    eval_tokens: int | None,
    no_eval: bool,
    overwrite: bool,
    resume: bool,
    quiet: bool,
    log_json: bool,
) -> None:
    """Prune MODEL's attention heads by --ratio and write the checkpoint to --out.

    The whole model is loaded. moecompress_report.json holds the chosen heads per layer, the gate trajectories,
    the KV-cache bytes per token before and after, and the evaluations. A killed run leaves its partial output
    hidden beside --out: --resume starts over (a whole-model pass keeps no partial state), --restart discards it;
    without either it is refused.
    """
    from ..checkpoint import resolve_model
    from ..device import using_device
    from ..loading import quiet_transformers
    from ..passes.prune_heads import PruneHeadsConfig, prune_heads

    quiet_transformers()
    config = PruneHeadsConfig(
        ratio=ratio,
        unit=unit,
        method=method,
        scope=scope,
        steps=steps,
        lr=lr,
        noise_bias=noise_bias,
        gate_objective=gate_objective,
        distill_steps=distill_steps,
        distill_lr=distill_lr,
        seed=seed,
    )
    config.validate()
    model_dir = resolve_model(model)
    check_one_pass_before_work(
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
    started = time.monotonic()
    with using_device(chosen_device()):
        report = prune_heads(
            model_dir,
            out_dir,
            config,
            calib=calib,
            calib_tokens=calib_tokens,
            seq_len=seq_len,
            batch_size=batch_size,
            eval_data=None if no_eval else eval_data,
            eval_tokens=eval_tokens,
            overwrite=overwrite,
            progress=True,
        )
    click.echo(
        f"removed {report['units_before'] - report['units_after']} of {report['units_before']} {unit}s ({method})"
    )
    for layer, info in report["layers"].items():
        click.echo(f"  layer {layer}: query heads {info['kept_query_heads']}, KV heads {info['kept_kv_heads']}")
    kv = report["kv_cache_bytes_per_token"]
    click.echo(f"KV cache {kv['before']} -> {kv['after']} bytes/token")
    click.echo(
        f"wrote {out_dir} in {time.monotonic() - started:.1f}s"
        + ("" if report["stock_loadable"] else "  (load after `import moecompress`)")
    )
    if "eval" in report:
        before, after = report["eval_before_distillation"], report["eval"]
        click.echo(
            f"perplexity {after['reference_perplexity']:.3f} -> {before['perplexity']:.3f} pruned -> "
            f"{after['perplexity']:.3f} distilled on {eval_data}; KL {after['kl']:.4f} nats/token"
        )
