"""The ``moecompress`` Click application.

Every command resolves its model argument the same way (a directory, ``builtin:tiny-moe``, or a hub id), and
turns a :class:`~moecompress.errors.UserInputError` into one line on stderr and exit code 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .. import __version__
from ..errors import UserInputError

MODEL_HELP = "a model directory, builtin:tiny-moe, or a Hugging Face hub id (org/name)"


def _human_int(value: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.2f}{unit}"
    return str(value)


def _human_bytes(value: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} B"


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


@app.command("inspect")
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def inspect_command(model: str, as_json: bool) -> None:
    """Describe MODEL: family, layers, experts, top-k, heads, parameters by class, bytes, dtypes.

    Only config.json and the safetensors headers are read, so this is instant even for 400B models.
    """
    from ..checkpoint import resolve_model
    from ..summary import summarize

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
        f"attention    {summary['attention_heads']} heads, {summary['kv_heads']} KV heads, head_dim {summary['head_dim']}",
        f"hidden size  {summary['hidden_size']}",
        f"on disk      {_human_bytes(summary['bytes_on_disk'])} in {summary['shards']} shard(s)",
        "dtypes       " + ", ".join(f"{k} {_human_int(v)}" for k, v in summary["dtypes"].items()),
        f"parameters   {_human_int(summary['parameters_total'])} total",
    ]
    total = summary["parameters_total"] or 1
    for name, count in summary["parameters"].items():
        if count:
            lines.append(f"  {name:<15}{_human_int(count):>10}  {100 * count / total:5.1f}%")
    click.echo("\n".join(lines))


@app.command("eval")
@click.argument("model")
@click.option("--data", default="builtin:prose", show_default=True,
              help="Evaluation source: builtin:prose|code[:heldout], a .txt/.jsonl/.parquet file, or "
                   "hf:NAME[:CONFIG][:SPLIT]. Built-in sources default to their held-out part.")
@click.option("--seq-len", default=256, show_default=True, type=click.IntRange(min=2),
              help="Tokens per window; windows are consecutive and do not overlap.")
@click.option("--max-tokens", type=click.IntRange(min=2), default=None,
              help="Evaluate at most this many tokens (whole windows).")
@click.option("--reference", default=None, help=f"Reference model for KL and routing agreement ({MODEL_HELP}).")
@click.option("--json-out", type=click.Path(dir_okay=False, writable=True, path_type=Path), default=None,
              help="Also write the results to this JSON file.")
def eval_command(model: str, data: str, seq_len: int, max_tokens: int | None, reference: str | None,
                 json_out: Path | None) -> None:
    """Perplexity of MODEL on DATA; with --reference, also KL(reference‖model) and routing agreement.

    Perplexity is exp(mean negative log-likelihood) over every predicted token of consecutive,
    non-overlapping windows of --seq-len tokens; text is tokenised without special tokens.
    """
    from ..checkpoint import resolve_model
    from ..evals.perplexity import evaluate

    model_dir = resolve_model(model)
    reference_dir = resolve_model(reference) if reference else None
    result = evaluate(model_dir, data, seq_len=seq_len, max_tokens=max_tokens, reference_dir=reference_dir,
                      progress=sys.stderr.isatty())
    payload = {"model": str(model_dir), "data": data, **result.to_json()}
    if reference_dir is not None:
        payload["reference"] = str(reference_dir)
    if json_out is not None:
        json_out.write_text(json.dumps(payload, indent=2) + "\n")
    click.echo(f"perplexity          {result.perplexity:.4f}  ({result.tokens} predicted tokens, "
               f"{result.windows} windows of {result.seq_len})")
    if result.kl is not None:
        click.echo(f"KL(ref‖model)       {result.kl:.6f} nats/token")
    if result.routing_agreement is not None:
        click.echo(f"routing agreement   {result.routing_agreement:.4f}")
    click.echo(f"speed               {result.tokens_per_second:.0f} tokens/s")


def main() -> None:
    """Console entry point: run the app, mapping user errors to one line and exit code 2."""
    debug = "--debug" in sys.argv[1:]
    try:
        app.main(standalone_mode=False)
    except UserInputError as error:
        if debug:
            raise
        click.echo(f"moecompress: error: {error}", err=True)
        sys.exit(2)
    except click.exceptions.Exit as exit_:
        sys.exit(exit_.exit_code)
    except click.ClickException as error:
        error.show()
        sys.exit(2 if isinstance(error, click.UsageError) else error.exit_code)
    except click.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
