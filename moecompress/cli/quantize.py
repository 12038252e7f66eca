"""``moecompress quantize``: low-bit experts (and optionally shared experts, attention, lm_head)."""

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
from .numbers import human_bytes as _human_bytes
from .pass_options import PassCommand, config_from_options, config_options
from .run_options import run_and_summarise, run_options
from .trust_options import trust_options


@click.command("quantize", cls=PassCommand)
@trust_options
@run_options
@click.argument("model")
@out_option()
@config_options("quantize", exclude=("lowrank_rank",))
@calib_option(
    "Calibration source(s), comma-separated, for gptq, --salient-fraction, --lowrank-budget and --imatrix-out (plain "
    "rtn needs none)."
)
@calib_tokens_option()
@seq_len_option()
@eval_options("Evaluate the quantised model against the input on this source (held-out part for built-ins).")
@overwrite_option()
@device_option
def quantize_command(
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
    """Quantise MODEL's routed experts (and --targets) and write the checkpoint to --out.

    The checkpoint is streamed one decoder layer at a time; peak memory is one layer (plus, for gptq, the
    calibration activations). moecompress_report.json holds the footprint (bytes and bits per weight, every
    scale and zero point included), GPTQ's per-expert token counts and fallbacks, and the evaluation.
    """
    from ..checkpoint import resolve_model
    from ..passes.quantize import QuantizeConfig
    from ..runner.recipes import Calibration, Evaluation, Recipe

    config = config_from_options(QuantizeConfig, options)
    config.validate()
    recipe = Recipe(
        model=model,
        calibration=Calibration(source=calib, tokens=calib_tokens, seq_len=seq_len, seed=config.seed),
        passes=[("quantize", config)],
        evaluation=None if no_eval else Evaluation(data=eval_data, tokens=eval_tokens),
    )
    report = run_and_summarise(recipe, resolve_model(model), out_dir, overwrite=overwrite, resume=resume)
    footprint = report["footprint"]
    source = report["source_footprint"]
    experts = footprint["classes"].get("experts", {})
    click.echo(
        f"quantised {report['quantized_modules']} modules to {report['scheme_description']} ({config.method}, "
        f"format {config.format})"
    )
    click.echo(
        f"experts {experts.get('bits_per_weight', 0):.3f} bits/weight; whole model "
        f"{footprint['total']['bits_per_weight']:.3f} bits/weight, "
        f"{_human_bytes(source['total']['bytes'])} -> {_human_bytes(footprint['total']['bytes'])}"
    )
    if experts.get("bitmap_raw_bytes"):
        click.echo(
            f"salient weights: bitmap {_human_bytes(experts['bitmap_bytes'])} as stored ({config.bitmap}) vs "
            f"{_human_bytes(experts['bitmap_raw_bytes'])} raw, values {_human_bytes(experts['salient_value_bytes'])}; "
            f"experts {experts['bits_per_weight_raw_bitmap']:.3f} bits/weight with a raw bitmap"
        )
    if "lowrank" in report:
        lowrank = report["lowrank"]
        measured = lowrank["measured_weighted_error"]
        click.echo(
            f"low-rank adapters: {lowrank['components_used']} rank-1 components ({config.rank_alloc}, sensitivity "
            f"{config.sensitivity}); weighted error {measured['without_adapters']:.4g} -> "
            f"{measured['with_adapters']:.4g} "
            f"(predicted {lowrank['predicted_weighted_error']['with_adapters']:.4g})"
        )
    if "imatrix" in report:
        imatrix = report["imatrix"]
        click.echo(
            f"importance matrix for llama-quantize: {imatrix['path']} ({len(imatrix['layers'])} layers: "
            f"{', '.join(imatrix['tensors_per_layer'])}{'; output' if imatrix['output'] else ''}; "
            f"{imatrix['chunk_count']} chunks of {imatrix['chunk_size']})"
        )
    fallback = sum(len(v) for v in report["rtn_fallback_experts"].values())
    if fallback:
        click.echo(
            f"{fallback} experts had fewer than {config.gptq_min_tokens} calibration tokens and used rtn (see report)"
        )
