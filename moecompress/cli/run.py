"""``moecompress run``: a recipe's passes, validated first, run in order."""

from __future__ import annotations

from pathlib import Path

import click

from .common_options import device_option, out_option, overwrite_option
from .run_options import run_and_summarise, run_options
from .trust_options import trust_options


@click.command("run")
@trust_options
@run_options
@click.argument("recipe", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--model", default=None, help="The model to compress (overrides the recipe's model).")
@out_option("Output directory (written atomically; required unless --dry-run).", required=False)
@click.option("--dry-run", is_flag=True, help="Validate the recipe and print the passes; do no work.")
@overwrite_option()
@device_option
def run_command(
    recipe: Path,
    model: str | None,
    out_dir: Path | None,
    dry_run: bool,
    overwrite: bool,
    resume: bool,
    quiet: bool,
    log_json: bool,
) -> None:
    """Run RECIPE (YAML: model, calibration, passes) and write the result to --out.

    The whole recipe is validated before any work: an unknown key, a wrong type or an impossible order of passes
    is one line naming the key's path, exit code 2. Passes run one after another on the previous pass's output,
    in a hidden sibling directory (.OUT.run); --out appears in one step when everything, the evaluation
    included, is done. A killed run continues with --resume. The run ends with a table of what changed
    (experts, heads, bytes, bits per weight, perplexity, routing agreement); `moecompress report OUT` reprints it.
    """
    from ..checkpoint import resolve_model
    from ..errors import UserInputError
    from ..runner.recipes import describe, load_recipe

    parsed = load_recipe(recipe)
    name = model or parsed.model
    if name is None:
        raise UserInputError(f"{recipe}: no model (give one in the recipe or with --model)")
    calibration = parsed.calibration
    header = (
        f"model {name}; calibration {calibration.source}, {calibration.tokens} tokens of {calibration.seq_len}, "
        f"seed {calibration.seed}"
    )
    steps = [f"  {index + 1}. {line}" for index, line in enumerate(describe(parsed))]
    if dry_run:
        from ..runner.pipeline import describe_plan

        click.echo("\n".join([header, *steps, "plan:", *(f"  {line}" for line in describe_plan(parsed))]))
        return
    if out_dir is None:
        raise UserInputError("--out is required (or pass --dry-run)")
    if overwrite:
        from ..runner.preflight import check_not_replacing_inputs

        check_not_replacing_inputs(out_dir, [recipe])

    def announce() -> None:
        if log_json:
            from ..progress import event

            event("recipe", header, passes=describe(parsed))
        elif not quiet:
            click.echo("\n".join([header, *steps]), err=True)

    run_and_summarise(parsed, resolve_model(name), out_dir, overwrite=overwrite, resume=resume, before_work=announce)
