"""``moecompress qat``: routing-replay quantisation-aware fine-tuning of expert-side adapters."""

from __future__ import annotations

import dataclasses
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
from .numbers import human_bytes
from .pass_options import PassCommand, config_from_options, config_options
from .run_options import run_one_pass_checked, run_options
from .trust_options import trust_options


@click.command("qat", cls=PassCommand)
@trust_options
@run_options
@click.argument("model")
@out_option("Output directory (native quantised format; written atomically; must not exist unless --overwrite).")
@config_options("qat")
@calib_option(
    "Training and PTQ calibration source(s), comma-separated (calibration part for built-ins).", old=("--data",)
)
@calib_tokens_option("Calibration tokens of the PTQ start (whole windows of --seq-len).")
@seq_len_option()
@eval_options(
    "Held-out source for perplexity, KL and routing agreement before (PTQ) and after training.",
    "Skip the before/after evaluation.",
)
@overwrite_option()
@device_option
def qat_command(
    model: str,
    out_dir: Path,
    seq_len: int,
    calib: str,
    calib_tokens: int,
    eval_data: str,
    eval_tokens: int | None,
    no_eval: bool,
    overwrite: bool,
    resume: bool,
    quiet: bool,
    log_json: bool,
    **options: Any,
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
    from ..errors import UserInputError
    from ..passes.qat import QATConfig

    if options["lowrank_rank"] is not None:
        if options["lowrank_budget"] is not None:
            raise UserInputError("give --adapter-rank or --lowrank-budget, not both")
        options["lowrank_budget"] = 0.0
    config = config_from_options(QATConfig, {**options, "seq_len": seq_len})
    config = dataclasses.replace(config, quantize=dataclasses.replace(config.quantize, seed=config.seed))
    config.validate()
    model_dir = resolve_model(model)
    report, seconds = run_one_pass_checked(
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
    qat = report["qat"]
    experts = report["footprint"]["classes"].get("experts", {})
    click.echo(
        f"trained {qat['trainable_parameters']:,} adapter parameters for {config.steps} steps (replay {qat['replay']}, "
        f"{qat['optimizer']}) in {seconds:.1f}s in all; "
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
