"""The ``moecompress`` Click application.

Every command resolves its model argument the same way (a directory, ``builtin:tiny-moe``, or a hub id), and
turns a :class:`~moecompress.errors.UserInputError` into one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from .. import __version__
from ..defaults import CALIBRATION_LEAST, DEFAULT_EVAL_DATA, DEFAULT_EVAL_TOKENS, DEFAULT_IMAGE_SIZE
from ..errors import UserInputError
from ..files import DiskFullError, is_full
from ..vocabulary import CALIBRATION_FLAGS, EVALUATION_FLAGS
from .bench import bench_group
from .common_options import (
    EVAL_TOKENS_HELP,
    EvalTokens,
    RenamedOption,
    calib_option,
    calib_tokens_option,
    chosen_device,
    device_option,
    eval_options,
    out_option,
    overwrite_option,
    seq_len_option,
)
from .export import export_command
from .interrupts import Interrupted, handling_signals, interrupted_line, resume_hint
from .numbers import human_bytes as _human_bytes
from .numbers import human_int as _human_int
from .pass_options import PassCommand, config_from_options, config_options
from .prune_heads import prune_heads_command
from .push import push_command
from .qat import qat_command
from .quantize import quantize_command
from .report import report_command
from .run import run_command
from .run_options import run_and_summarise, run_options
from .trust_options import trust_options

MODEL_HELP = "a model directory, builtin:tiny-moe, or a Hugging Face hub id (org/name)"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="moecompress")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.pass_context
def app(ctx: click.Context, debug: bool) -> None:
    """Compress Hugging Face Mixture-of-Experts checkpoints into checkpoints stock tools load.

    MODEL arguments accept a local directory, builtin:tiny-moe (a small model shipped with the package),
    or a Hugging Face hub id resolved through the local cache.
    """
    ctx.obj = {"debug": debug}
    from ..loading import quiet_transformers
    from ..progress import end_of_command

    ctx.call_on_close(end_of_command)

    quiet_transformers()


@app.command("inspect")
@trust_options
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect_command(model: str, as_json: bool) -> None:
    """Describe MODEL: family, layers, experts, top-k, heads, parameters by class, bytes, dtypes.

    Only config.json and the safetensors headers are read, so this is instant even for 400B models.
    """
    from ..checkpoint import resolve_model
    from ..evals.checkpoint_summary import summarize

    summary = summarize(resolve_model(model))
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    counts = sorted(set(summary["experts_per_layer"].values()))
    experts = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]} (varies by layer)"
    lines = [
        f"model        {summary['path']}",
        f"family       {summary['family']} (model_type {summary['model_type']})",
        f"layers       {summary['num_layers']} decoder layers, {len(summary['moe_layers'])} MoE",
        f"experts      {experts} routed per MoE layer, top-{summary['top_k']}",
        f"attention    {summary['attention_heads']} heads, {summary['kv_heads']} KV heads, "
        f"head_dim {summary['head_dim']}",
        f"hidden size  {summary['hidden_size']}",
        f"on disk      {_human_bytes(summary['bytes_on_disk'])} in {summary['shards']} shard(s)",
        "dtypes       " + ", ".join(f"{k} {_human_int(v)}" for k, v in summary["dtypes"].items()),
        f"quantized    {summary['quantization'] or 'no'}",
        *(
            [f"loading      `import moecompress` before from_pretrained ({summary['needs_plugin']})"]
            if summary["needs_plugin"]
            else []
        ),
        f"parameters   {_human_int(summary['parameters_total'])} total "
        f"({summary['footprint']['total']['bits_per_weight']:.3f} bits/weight incl. scales and metadata)",
    ]
    total = summary["parameters_total"] or 1
    classes = summary["footprint"]["classes"]
    for name, count in summary["parameters"].items():
        if count:
            bits = classes[name]["bits_per_weight"]
            lines.append(f"  {name:<15}{_human_int(count):>10}  {100 * count / total:5.1f}%  {bits:7.3f} bits/weight")
    click.echo("\n".join(lines))


@app.command("eval")
@trust_options
@click.argument("model")
@click.option(
    EVALUATION_FLAGS["data"],
    "data",
    cls=RenamedOption,
    old=("--data",),
    default=DEFAULT_EVAL_DATA,
    show_default=True,
    help="Evaluation source: builtin:prose|code[:heldout], a .txt/.jsonl/.parquet file, or "
    "hf:NAME[:CONFIG][:SPLIT]. Built-in sources default to their held-out part.",
)
@seq_len_option("Tokens per window; windows are consecutive and do not overlap.")
@click.option(
    EVALUATION_FLAGS["tokens"],
    "max_tokens",
    cls=RenamedOption,
    old=("--max-tokens",),
    type=EvalTokens(),
    default=str(DEFAULT_EVAL_TOKENS),
    show_default=True,
    help=EVAL_TOKENS_HELP,
)
@click.option("--reference", default=None, help=f"Reference model for KL and routing agreement ({MODEL_HELP}).")
@click.option(
    "--json-out",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    default=None,
    help="Also write the results to this JSON file.",
)
@device_option
def eval_command(
    model: str, data: str, seq_len: int, max_tokens: int | None, reference: str | None, json_out: Path | None
) -> None:
    """Perplexity of MODEL on --eval-data; with --reference, also KL(reference‖model) and routing agreement.

    Perplexity is exp(mean negative log-likelihood) over every predicted token of consecutive,
    non-overlapping windows of --seq-len tokens; text is tokenised without special tokens.
    """
    from ..checkpoint import resolve_model
    from ..device import using_device
    from ..evals.perplexity import evaluate
    from ..files import write_json
    from ..loading import load_adapter
    from ..runner.preflight import (
        check_data_spec,
        check_eval_window,
        check_file_target,
        check_not_in_inputs,
        check_seq_len,
        data_paths,
    )

    model_dir = resolve_model(model)
    reference_dir = resolve_model(reference) if reference else None
    if json_out is not None:
        check_not_in_inputs(json_out, [model_dir, reference_dir, *data_paths(data)], f"--json-out {json_out}")
        check_file_target(json_out, f"--json-out {json_out}")
    check_seq_len(load_adapter(model_dir), seq_len)
    given = click.get_current_context().get_parameter_source("max_tokens") != click.core.ParameterSource.DEFAULT
    check_eval_window(seq_len, max_tokens, given)
    check_data_spec(data, "--eval-data")
    with using_device(chosen_device()):
        result = evaluate(
            model_dir,
            data,
            seq_len=seq_len,
            max_tokens=max_tokens,
            reference_dir=reference_dir,
            progress=sys.stderr.isatty(),
        )
    payload = {"model": str(model_dir), "data": data, **result.to_json(with_speed=True)}
    if reference_dir is not None:
        payload["reference"] = str(reference_dir)
    if json_out is not None:
        write_json(json_out, payload)
    click.echo(
        f"perplexity          {result.perplexity:.4f}  ({result.tokens} predicted tokens, "
        f"{result.windows} windows of {result.seq_len})"
    )
    if result.kl is not None:
        click.echo(f"KL(ref‖model)       {result.kl:.6f} nats/token")
    if result.routing_agreement is not None:
        click.echo(f"routing agreement   {result.routing_agreement:.4f}")
    click.echo(f"speed               {result.tokens_per_second:.0f} tokens/s")


@app.command("prune", cls=PassCommand)
@trust_options
@run_options
@click.argument("model")
@out_option()
@config_options("prune_experts")
@calib_option(
    "Calibration source(s), comma-separated; built-in sources use their calibration part. "
    "Vision-language models also take image+caption sources: builtin:shapes[:N], "
    "builtin:stripes[:N], or hf:NAME with an image column (tokens tagged vision/text)."
)
@calib_tokens_option("Calibration tokens for text sources (image sources: builtin:shapes:N takes N images).")
@click.option(
    CALIBRATION_FLAGS["image_size"],
    type=click.IntRange(min=CALIBRATION_LEAST["image_size"]),
    default=DEFAULT_IMAGE_SIZE,
    show_default=True,
    help="Side in pixels that calibration images are drawn or resized to.",
)
@seq_len_option()
@eval_options("Evaluate the pruned model against the input on this source (held-out part for built-ins).")
@overwrite_option()
@device_option
def prune_command(
    model: str,
    out_dir: Path,
    calib: str,
    calib_tokens: int,
    image_size: int,
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
    """Remove routed experts from MODEL and write the smaller checkpoint to --out.

    Calibration tokens are streamed through the model one decoder layer at a time; every expert is scored,
    the lowest are removed (router rows and biases sliced, shared experts untouched, config rewritten), and
    moecompress_report.json lists each layer's kept original expert ids and every expert's scores.
    """
    from ..calibration import distributed
    from ..checkpoint import resolve_model
    from ..passes.prune_experts import PruneExpertsConfig
    from ..runner.recipes import Calibration, Evaluation, Recipe

    config = config_from_options(PruneExpertsConfig, options)
    config.validate()
    recipe = Recipe(
        model=model,
        calibration=Calibration(
            source=calib, tokens=calib_tokens, seq_len=seq_len, seed=config.seed, image_size=image_size
        ),
        passes=[("prune_experts", config)],
        evaluation=None if no_eval else Evaluation(data=eval_data, tokens=eval_tokens),
    )
    report = run_and_summarise(recipe, resolve_model(model), out_dir, overwrite=overwrite, resume=resume)
    if not distributed.is_writer():
        return
    counts = [len(layer["kept"]) for layer in report["layers"].values()]
    verb = "merged away" if config.method == "merge" else "pruned"
    refit = ", router refitted" if config.recalibrate_router else ""
    click.echo(
        f"{verb} {report['experts_before'] - report['experts_after']} of {report['experts_before']} routed "
        f"experts ({config.method}, scope {config.scope}{refit}); kept per layer: {', '.join(map(str, counts))}"
        + ("" if report["uniform"] else "  (per-layer counts differ: load after `import moecompress`)")
    )


app.add_command(quantize_command)
app.add_command(prune_heads_command)
app.add_command(qat_command)
app.add_command(run_command)
app.add_command(push_command)
app.add_command(report_command)
app.add_command(export_command)
app.add_command(bench_group)


def main() -> None:
    """Console entry point: run the app, mapping user errors and a full disk to one line and exit code 2, and
    SIGINT/SIGTERM to one line and 128 + the signal (:mod:`.interrupts`)."""
    debug = "--debug" in sys.argv[1:]
    try:
        with handling_signals():
            app.main(standalone_mode=False)
    except Interrupted as stop:
        click.echo(interrupted_line(app, sys.argv[1:], stop), err=True)
        sys.exit(stop.exit_code)
    except DiskFullError as error:
        if debug:
            raise
        click.echo(f"moecompress: error: {error}{resume_hint(app, sys.argv[1:], 'make room and ')}", err=True)
        sys.exit(2)
    except UserInputError as error:
        if debug:
            raise
        click.echo(f"moecompress: error: {error}", err=True)
        sys.exit(2)
    except click.exceptions.Exit as exit_:
        sys.exit(exit_.exit_code)
    except OSError as error:
        if debug or not is_full(error):
            raise
        full = DiskFullError(error.filename or "a file", error.errno)
        click.echo(f"moecompress: error: {full}{resume_hint(app, sys.argv[1:], 'make room and ')}", err=True)
        sys.exit(2)
    except click.UsageError as error:
        if debug or type(error).__name__ == "NoArgsIsHelpError":
            error.show()
            sys.exit(2)
        command = error.ctx.command_path if error.ctx is not None else "moecompress"
        message = " ".join(error.format_message().split())
        click.echo(f"moecompress: error: {message} (see '{command} --help')", err=True)
        sys.exit(2)
    except click.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
    except click.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
