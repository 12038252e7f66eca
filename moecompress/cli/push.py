"""``moecompress push``: upload a finished output to the Hugging Face Hub in one commit, with a model card."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import UserInputError
from .numbers import human_bytes as _human_bytes


@click.command("push")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--repo-id", required=True, help="Hub model repository to push to, as ORG/NAME (created if it does not exist)."
)
@click.option(
    "--private",
    is_flag=True,
    help="Create the repository private. Only applies when it is created; without it the namespace's default "
    "visibility is used.",
)
@click.option(
    "--revision",
    default=None,
    help="Branch to commit to; created from main when missing (default: main).",
)
@click.option(
    "--base-model",
    default=None,
    help="Hub id (ORG/NAME) of the original model, for the card's base_model. Needed only when it cannot be "
    "read from the source directory (a Hub cache snapshot, or a config.json _name_or_path); without it the "
    "field is left out.",
)
@click.option("--commit-message", default=None, help="Commit summary (default: names the passes).")
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the model card and the files that would be uploaded, and send nothing (no token needed).",
)
def push_command(
    directory: Path,
    repo_id: str,
    private: bool,
    revision: str | None,
    base_model: str | None,
    commit_message: str | None,
    dry_run: bool,
) -> None:
    """Upload the moecompress output DIRECTORY to the Hub as one commit, with a generated model card.

    DIRECTORY must be a finished moecompress output (moecompress_report.json, config.json and safetensors
    weights, no MOECOMPRESS_INCOMPLETE marker); it is never modified. The card (uploaded as README.md, in
    place of any README.md the directory holds) carries base_model, base_model_relation, library_name, tags
    and the source's license in its front matter, then the report's measurements, how to load the model,
    and the recipe. The token comes from HF_TOKEN or `hf auth login` and is never printed; HF_ENDPOINT
    selects another Hub endpoint.
    """
    from ..hub import plan_push, push_plan

    plan = plan_push(directory, repo_id, base_model=base_model)
    for warning in plan.card.warnings:
        click.echo(f"moecompress: warning: {warning}", err=True)
    target = f"{repo_id} (revision {revision or 'main'})"
    if dry_run:
        click.echo(plan.card.text.rstrip("\n"))
        click.echo("")
        click.echo(
            f"--dry-run: would upload {len(plan.files) + 1} files ({_human_bytes(plan.total_bytes)}) "
            f"to {target} in one commit:"
        )
        for name, local in plan.files:
            click.echo(f"  {_human_bytes(local.stat().st_size):>11}  {name}")
        note = "the card above" + (", replacing the directory's README.md" if plan.replaces_readme else "")
        click.echo(f"  {_human_bytes(len(plan.card.text.encode())):>11}  README.md  ({note})")
        return
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise UserInputError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (or use --dry-run)")
    url = push_plan(plan, token=token, private=private, revision=revision, commit_message=commit_message)
    click.echo(
        f"pushed {len(plan.files) + 1} files ({_human_bytes(plan.total_bytes)}) to {target} in one commit: {url}"
    )
