"""``moecompress qat``: routing-replay quantisation-aware fine-tuning of expert-side adapters."""

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
from .numbers import human_bytes
from .run_options import check_one_pass_before_work, run_options
from .trust_options import trust_options

GROUP_SIZE_HELP = (
    "Weights per scale: int4, int2 and w4a8 take 32, 64 or 128 (default 32); binary 32, 64, 128 or 256 (default "
    "128); mxfp4 blocks are always 32 wide, so mxfp4 refuses any other value."
)


@click.command("qat")
@trust_options
@run_options
@click.argument("model")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Output directory (native quantised format; written atomically; must not exist unless --overwrite).",
)
@click.option(
    "--scheme",
    type=click.Choice(["mxfp4", "int4", "int2", "w4a8", "binary"]),
    required=True,
    help="Expert quantisation scheme (as in `moecompress quantize`).",
)
@click.option(
    "--method",
    type=click.Choice(["rtn", "gptq"]),
    default="rtn",
    show_default=True,
    help="How the experts are quantised before training.",
)
@click.option("--group-size", type=click.Choice(["32", "64", "128", "256"]), default=None, help=GROUP_SIZE_HELP)
@click.option("--symmetric/--asymmetric", default=None, help="As in quantize (default symmetric, asymmetric for int2).")
@click.option(
    "--replay",
    default="none",
    show_default=True,
    help="When the full-precision model's recorded routes replace the student's own during training: all, none, "
    "first:F (the first fraction F of the steps, then free routing) or layers:L1,L2 (those MoE layers). "
    "In held-out perplexity replay did not beat none on builtin:tiny-moe or on 64-expert and 12-layer models "
    "(docs/qat.md), hence the default; it lowered the KL to the full-precision model slightly.",
)
@click.option(
    "--replay-weights",
    type=click.Choice(["router", "recorded"]),
    default="router",
    show_default=True,
    help="router: the replayed experts' weights come from the student's frozen router on its own hidden states; "
    "recorded: the full-precision model's weights as recorded.",
)
@click.option("--steps", type=click.IntRange(min=1), default=200, show_default=True, help="Optimiser steps.")
@click.option(
    "--lr",
    type=click.FloatRange(min=0, min_open=True),
    default=1e-3,
    show_default=True,
    help="Learning rate of the adapters (AdamW).",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Windows per step.")
@seq_len_option()
@click.option(
    "--train-tokens",
    type=click.IntRange(min=2),
    default=65536,
    show_default=True,
    help="Tokens of --calib (random whole windows) that training cycles through.",
)
@click.option(
    "--adapter-rank",
    type=click.IntRange(min=1),
    default=None,
    help="The same adapter rank for every routed expert matrix (instead of --lowrank-budget).",
)
@click.option(
    "--lowrank-budget",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Adapter budget in bits per routed expert weight, spent by load as in quantize [default: 0.375, unless "
    "--adapter-rank is given].",
)
@click.option(
    "--rank-alloc",
    type=click.Choice(["load", "uniform"]),
    default="load",
    show_default=True,
    help="How --lowrank-budget is spent (see quantize).",
)
@click.option(
    "--lm-loss-weight",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Add this times the language-modelling loss to the distillation KL.",
)
@calib_option(
    "Training and PTQ calibration source(s), comma-separated (calibration part for built-ins).", old=("--data",)
)
@calib_tokens_option("Calibration tokens of the PTQ start (whole windows of --seq-len).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for windows and batch order.")
@eval_options(
    "Held-out source for perplexity, KL and routing agreement before (PTQ) and after training.",
    "Skip the before/after evaluation.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@device_option
def qat_command(
    model: str,
    out_dir: Path,
    scheme: str,
    method: str,
    group_size: str | None,
    symmetric: bool | None,
    replay: str,
    replay_weights: str,
    steps: int,
    lr: float,
    batch_size: int,
    seq_len: int,
    train_tokens: int,
    adapter_rank: int | None,
    lowrank_budget: float | None,
    rank_alloc: str,
    lm_loss_weight: float,
    calib: str,
    calib_tokens: int,
    seed: int,
    eval_data: str,
    eval_tokens: int | None,
    no_eval: bool,
    overwrite: bool,
    resume: bool,
    quiet: bool,
    log_json: bool,
) -> None:
    """Quantise MODEL's routed experts with load-aware error adapters, then fine-tune the adapters by
    distillation from MODEL with its routes replayed; write the native quantised checkpoint to --out.

    The router, attention, norms and the quantised expert weights stay frozen; only the adapters train. Both
    models are held in memory. moecompress_report.json holds the loss curve, the student's own routing agreement
    during training, and perplexity, KL and routing agreement before (= the PTQ result) and after.
    A killed run leaves its partial output hidden beside --out: --resume starts the training over (a whole-model
    pass keeps no partial state), --restart discards it; without either it is refused.
    """
    from ..checkpoint import resolve_model
    from ..device import using_device
    from ..errors import UserInputError
    from ..passes.qat import DEFAULT_LOWRANK_BUDGET, QATConfig, qat_checkpoint
    from ..passes.quantize import QuantizeConfig

    if adapter_rank is not None and lowrank_budget is not None:
        raise UserInputError("give --adapter-rank or --lowrank-budget, not both")
    quantize = QuantizeConfig(
        scheme=scheme,
        method=method,
        group_size=None if group_size is None else int(group_size),
        symmetric=symmetric,
        lowrank_budget=0.0 if adapter_rank else (lowrank_budget or DEFAULT_LOWRANK_BUDGET),
        lowrank_rank=adapter_rank or 0,
        rank_alloc=rank_alloc,
        seed=seed,
    )
    config = QATConfig(
        quantize=quantize,
        replay=replay,
        replay_weights=replay_weights,
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        seq_len=seq_len,
        train_tokens=train_tokens,
        lm_loss_weight=lm_loss_weight,
        seed=seed,
    )
    config.validate()
    model_dir = resolve_model(model)
    check_one_pass_before_work(
        model_dir,
        out_dir,
        "qat",
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
        report = qat_checkpoint(
            model_dir,
            out_dir,
            config,
            data=calib,
            calib_tokens=calib_tokens,
            eval_data=None if no_eval else eval_data,
            eval_tokens=eval_tokens,
            overwrite=overwrite,
            progress=True,
        )
    qat = report["qat"]
    experts = report["footprint"]["classes"].get("experts", {})
    click.echo(
        f"trained {qat['trainable_parameters']:,} adapter parameters for {steps} steps (replay {qat['replay']}, "
        f"{qat['optimizer']}) in {time.monotonic() - started:.1f}s in all; "
        f"loss {qat['loss'][0]:.4f} -> {qat['loss'][-1]:.4f}"
    )
    click.echo(
        f"experts {experts.get('bits_per_weight', 0):.3f} bits/weight; "
        f"{human_bytes(report['source_footprint']['total']['bytes'])} -> "
        f"{human_bytes(report['footprint']['total']['bytes'])}; wrote {out_dir}"
    )
    if "eval" in report:
        before, after = report["eval"]["before"], report["eval"]["after"]
        click.echo(
            f"perplexity {before['reference_perplexity']:.3f} (full precision), {before['perplexity']:.3f} (PTQ) -> "
            f"{after['perplexity']:.3f} (QAT) on {eval_data}"
        )
        click.echo(
            f"KL {before['kl']:.4f} -> {after['kl']:.4f} nats/token; routing agreement "
            f"{before['routing_agreement']:.4f} -> {after['routing_agreement']:.4f}"
        )
