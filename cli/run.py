"""``moecompress run``: a recipe's passes, validated first, run in order."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .trust_options import trust_options


@click.command("run")
@trust_options
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--model", default=None, help="The model to compress (overrides the recipe's model).")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Output directory (written atomically; required unless --dry-run).",
)
@click.option("--dry-run", is_flag=True, help="Validate the recipe and print the passes; do no work.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory.")
def run_command(recipe: Path, model: str | None, out_dir: Path | None, dry_run: bool, overwrite: bool) -> None:
    """Run RECIPE (YAML: model, calibration, passes) and write the result to --out.

    The whole recipe is validated before any work: an unknown key, a wrong type or an impossible order of passes
    is one line naming the key's path, exit code 2. Passes run one after another on the previous pass's output.
    """
    from ..checkpoint import resolve_model
    from ..errors import UserInputError
    from ..recipes import describe, load_recipe, run_recipe

    parsed = load_recipe(recipe)
    name = model or parsed.model
    if name is None:
        raise UserInputError(f"{recipe}: no model (give one in the recipe or with --model)")
    calibration = parsed.calibration
    click.echo(
        f"model {name}; calibration {calibration.source}, {calibration.tokens} tokens of {calibration.seq_len}, "
        f"seed {calibration.seed}"
    )
    for index, line in enumerate(describe(parsed)):
        click.echo(f"  {index + 1}. {line}")
    if dry_run:
        return
    if out_dir is None:
        raise UserInputError("--out is required (or pass --dry-run)")
    report = run_recipe(parsed, resolve_model(name), out_dir, overwrite=overwrite, progress=sys.stderr.isatty())
    click.echo(f"wrote {out_dir}")
    if "eval" in report:
        result = report["eval"]
        click.echo(
            f"perplexity {result['reference_perplexity']:.3f} -> {result['perplexity']:.3f} on {result['data']}; "
            f"KL {result['kl']:.4f} nats/token; routing agreement {result['routing_agreement']:.4f}"
        )
