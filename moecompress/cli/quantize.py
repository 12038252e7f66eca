"""``moecompress quantize``: low-bit experts (and optionally shared experts, attention, lm_head)."""

from __future__ import annotations

from pathlib import Path

import click

from .common_options import calib_option, calib_tokens_option, device_option, eval_options, seq_len_option
from .numbers import human_bytes as _human_bytes
from .run_options import run_and_summarise, run_options
from .trust_options import trust_options

GROUP_SIZE_HELP = (
    "Weights per scale: int4, int2 and w4a8 take 32, 64 or 128 (default 32); binary 32, 64, 128 or 256 (default "
    "128); mxfp4 blocks are always 32 wide, so mxfp4 refuses any other value."
)


@click.command("quantize")
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
    "--scheme",
    type=click.Choice(["mxfp4", "int4", "int2", "w4a8", "binary"]),
    default="mxfp4",
    show_default=True,
    help="mxfp4: OCP MXFP4 (E2M1, 32-wide E8M0 blocks); int4/int2: group-wise integers; "
    "w4a8: int4 weights with int8 per-token activations at inference; binary: sign bits with a bf16 scale "
    "per group (use with --salient-fraction).",
)
@click.option(
    "--method",
    type=click.Choice(["rtn", "gptq"]),
    default="rtn",
    show_default=True,
    help="rtn: round to nearest, no calibration (streams at disk speed); gptq: per-expert GPTQ on the "
    "calibration tokens routed to each expert.",
)
@click.option(
    "--group-size",
    type=click.Choice(["32", "64", "128", "256"]),
    default=None,
    help=GROUP_SIZE_HELP,
)
@click.option(
    "--symmetric/--asymmetric",
    default=None,
    help="Integer grid centred on zero, or with a per-group zero point (default: symmetric, asymmetric for int2).",
)
@click.option(
    "--scale-rule",
    type=click.Choice(["floor", "ceil"]),
    default="floor",
    show_default=True,
    help="MXFP4 block exponent: floor(log2 amax) - 2 (OCP) or ceil(log2(amax/6)) (gpt-oss, never saturates).",
)
@click.option(
    "--salient-fraction",
    type=click.FloatRange(min=0, max=0.5),
    default=0.0,
    show_default=True,
    help="Share of each routed expert matrix's weights kept exactly in bf16, the largest |w| x input RMS over "
    "the calibration tokens routed to the expert (needs calibration; native format only). 0.01 suits binary.",
)
@click.option(
    "--bitmap",
    type=click.Choice(["rice", "golomb", "raw"]),
    default="rice",
    show_default=True,
    help="How the salient weights' positions are stored: a Rice- or Golomb-coded bitmap (within 1% of H(p) "
    "bits per position; Rice decodes faster) or raw (one bit per position, for comparison).",
)
@click.option(
    "--targets",
    default="experts",
    show_default=True,
    help="Comma-separated: experts (routed), shared_experts, attention, lm_head. Routers and norms are never "
    "quantised.",
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["native", "gpt-oss", "compressed-tensors"]),
    default="native",
    show_default=True,
    help="native: loads in transformers after `import moecompress`; gpt-oss: GPT-OSS's own MXFP4 layout "
    "(stock transformers); compressed-tensors: what vLLM serves.",
)
@calib_option(
    "Calibration source(s), comma-separated, for gptq, --salient-fraction and --lowrank-budget (plain rtn needs none)."
)
@calib_tokens_option()
@seq_len_option()
@click.option(
    "--gptq-min-tokens",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Experts routed fewer calibration tokens fall back to rtn (listed in the report).",
)
@click.option(
    "--gptq-damp",
    type=click.FloatRange(min=0, min_open=True),
    default=0.01,
    show_default=True,
    help="GPTQ: added to the Hessian's diagonal as this fraction of its mean, for a stable inverse.",
)
@click.option(
    "--lowrank-budget",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Low-rank error adapters after quantisation, in bits per routed expert weight (e.g. 0.25); bf16 "
    "adapters whose rank is spent where calibration tokens go. 0 disables.",
)
@click.option(
    "--rank-alloc",
    type=click.Choice(["load", "uniform"]),
    default="load",
    show_default=True,
    help="load: one budget over every expert matrix, largest load × σ² first; uniform: the same rank everywhere.",
)
@click.option(
    "--load-weighting",
    type=click.Choice(["tokens", "gate"]),
    default="gate",
    show_default=True,
    help="gate: each routed token counts with its squared routing weight (the block-output error); tokens: "
    "every routed token counts alike (an expert's load is its share of routed tokens).",
)
@click.option(
    "--sensitivity",
    type=click.Choice(["fisher-token", "fisher", "none"]),
    default="fisher-token",
    show_default=True,
    help="Downstream weight of each token's adapter error, from one gradient pass over the calibration data "
    "(streamed layer by layer, each layer read twice): fisher-token: ‖∂loss/∂block output‖² per token; "
    "fisher: its mean per layer; none: 1 (skips the pass).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for calibration windows.")
@click.option(
    "--mtp",
    type=click.Choice(["keep", "drop"]),
    default="keep",
    show_default=True,
    help="Multi-token-prediction layers (DeepSeek-V3/R1, Kimi-K2, GLM-4.5): keep (written unquantised in the "
    "decoded dtype, outside quantization_config) or drop (not written, num_nextn_predict_layers 0).",
)
@eval_options("Evaluate the quantised model against the input on this source (held-out part for built-ins).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
@device_option
def quantize_command(
    model: str,
    out_dir: Path,
    scheme: str,
    method: str,
    group_size: str | None,
    symmetric: bool | None,
    scale_rule: str,
    salient_fraction: float,
    bitmap: str,
    targets: str,
    output_format: str,
    calib: str,
    calib_tokens: int,
    seq_len: int,
    gptq_min_tokens: int,
    gptq_damp: float,
    lowrank_budget: float,
    rank_alloc: str,
    load_weighting: str,
    sensitivity: str,
    seed: int,
    mtp: str,
    eval_data: str,
    eval_tokens: int | None,
    no_eval: bool,
    overwrite: bool,
    resume: bool,
    quiet: bool,
    log_json: bool,
) -> None:
    """Quantise MODEL's routed experts (and --targets) and write the checkpoint to --out.

    The checkpoint is streamed one decoder layer at a time; peak memory is one layer (plus, for gptq, the
    calibration activations). moecompress_report.json holds the footprint (bytes and bits per weight, every
    scale and zero point included), GPTQ's per-expert token counts and fallbacks, and the evaluation.
    """
    from ..checkpoint import resolve_model
    from ..passes.quantize import QuantizeConfig
    from ..recipes import Calibration, Evaluation, Recipe

    config = QuantizeConfig(
        scheme=scheme,
        method=method,
        group_size=None if group_size is None else int(group_size),
        symmetric=symmetric,
        scale_rule=scale_rule,
        salient_fraction=salient_fraction,
        bitmap=bitmap,
        targets=tuple(t.strip() for t in targets.split(",") if t.strip()),
        format=output_format,
        gptq_min_tokens=gptq_min_tokens,
        gptq_damp=gptq_damp,
        lowrank_budget=lowrank_budget,
        rank_alloc=rank_alloc,
        load_weighting=load_weighting,
        sensitivity=sensitivity,
        seed=seed,
        mtp=mtp,
    )
    config.validate()
    recipe = Recipe(
        model=model,
        calibration=Calibration(source=calib, tokens=calib_tokens, seq_len=seq_len, seed=seed),
        passes=[("quantize", config)],
        evaluation=None if no_eval else Evaluation(data=eval_data, tokens=eval_tokens),
    )
    report = run_and_summarise(recipe, resolve_model(model), out_dir, overwrite=overwrite, resume=resume)
    footprint = report["footprint"]
    source = report["source_footprint"]
    experts = footprint["classes"].get("experts", {})
    click.echo(
        f"quantised {report['quantized_modules']} modules to {report['scheme_description']} ({method}, "
        f"format {output_format})"
    )
    click.echo(
        f"experts {experts.get('bits_per_weight', 0):.3f} bits/weight; whole model "
        f"{footprint['total']['bits_per_weight']:.3f} bits/weight, "
        f"{_human_bytes(source['total']['bytes'])} -> {_human_bytes(footprint['total']['bytes'])}"
    )
    if experts.get("bitmap_raw_bytes"):
        click.echo(
            f"salient weights: bitmap {_human_bytes(experts['bitmap_bytes'])} as stored ({bitmap}) vs "
            f"{_human_bytes(experts['bitmap_raw_bytes'])} raw, values {_human_bytes(experts['salient_value_bytes'])}; "
            f"experts {experts['bits_per_weight_raw_bitmap']:.3f} bits/weight with a raw bitmap"
        )
    if "lowrank" in report:
        lowrank = report["lowrank"]
        measured = lowrank["measured_weighted_error"]
        click.echo(
            f"low-rank adapters: {lowrank['components_used']} rank-1 components ({rank_alloc}, sensitivity "
            f"{sensitivity}); weighted error {measured['without_adapters']:.4g} -> {measured['with_adapters']:.4g} "
            f"(predicted {lowrank['predicted_weighted_error']['with_adapters']:.4g})"
        )
    fallback = sum(len(v) for v in report["rtn_fallback_experts"].values())
    if fallback:
        click.echo(f"{fallback} experts had fewer than {gptq_min_tokens} calibration tokens and used rtn (see report)")
