"""Options every pipeline command shares (``--resume``, ``--quiet``, ``--log-json``) and the one way they all
run: a recipe (a one-pass recipe for the shortcut commands) through :func:`~moecompress.runner.recipes.run_recipe`,
ending with the summary table."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from .. import progress


def _configure(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    ctx.meta[f"moecompress.{param.name}"] = value
    quiet, log_json = ctx.meta.get("moecompress.quiet", False), ctx.meta.get("moecompress.log_json", False)
    if quiet and log_json:
        raise click.UsageError("--quiet and --log-json exclude each other")
    progress.configure(quiet=quiet, log_json=log_json)
    return value


def _remember(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    ctx.meta[f"moecompress.{param.name}"] = value
    return value


def run_options(command: Callable) -> Callable:
    command = click.option(
        "--restart",
        is_flag=True,
        expose_value=False,
        callback=_remember,
        help="Discard the partial work a killed run into the same --out left (hidden .OUT.run or .OUT.incomplete) "
        "and start over; without --resume or --restart such work is refused, never removed.",
    )(command)
    command = click.option(
        "--resume",
        is_flag=True,
        help="Continue a run that was killed (same recipe and --out): finished passes and layers are kept, and the "
        "output is byte-identical to an uninterrupted run.",
    )(command)
    command = click.option(
        "--log-json",
        is_flag=True,
        callback=_configure,
        help="Progress and milestones as JSON lines on stderr (the summary also, as one JSON object).",
    )(command)
    return click.option(
        "--quiet", "-q", is_flag=True, callback=_configure, help="No progress output; errors and results only."
    )(command)


def check_before_work(out_dir: Path, model_dir: Path, *, overwrite: bool, resume: bool) -> None:
    """The output-side checks every writing command makes before any work: --out is not the input nor inside it,
    can be created, is not there already (unless --overwrite), and no interrupted run's partial work is there
    unless --resume or --restart says what to do with it (:func:`~moecompress.runner.preflight.check_output`). The
    output's lock it takes is given back when the command ends."""
    from ..runner import lock as run_lock
    from ..runner.preflight import check_output

    context = click.get_current_context()
    restart = context.meta.get("moecompress.restart", False)
    check_output(out_dir, model_dir, overwrite=overwrite, resume=resume, restart=restart, discard=False)
    context.call_on_close(lambda: run_lock.release(out_dir))


def start_over_if_asked(out_dir: Path) -> None:
    """With --restart, remove an interrupted run's partial work (called once every check has passed)."""
    from ..runner.preflight import discard_partial_work

    if click.get_current_context().meta.get("moecompress.restart", False):
        discard_partial_work(out_dir)


def run_one_pass_checked(
    model_dir: Path,
    out_dir: Path,
    pass_name: str,
    config: Any,
    *,
    overwrite: bool,
    resume: bool,
    calib: str,
    calib_tokens: int,
    seq_len: int,
    eval_data: str | None,
    eval_tokens: int | None,
) -> tuple[dict[str, Any], float]:
    """What a one-pass command that runs its pass directly (not as a recipe) does: every check before any work (the
    output, then the pass against the input's config.json, then --restart's discard), then the pass on the chosen
    device (``eval_data`` None: no evaluation). Returns the pass's report and the seconds it took."""
    from ..defaults import DEFAULT_IMAGE_SIZE
    from ..device import using_device
    from ..runner.pipeline import run_one_pass
    from ..runner.preflight import check_passes
    from .common_options import chosen_device, refuse_unused_common

    refuse_unused_common([(pass_name, config)], eval_data is not None, calib)
    check_before_work(out_dir, model_dir, overwrite=overwrite, resume=resume)
    check_passes(
        model_dir,
        [(pass_name, config)],
        calib_source=calib,
        calib_tokens=calib_tokens,
        seq_len=seq_len,
        eval_data=eval_data,
        eval_tokens=eval_tokens,
    )
    start_over_if_asked(out_dir)
    started = time.monotonic()
    with using_device(chosen_device()):
        report = run_one_pass(
            pass_name,
            config,
            model_dir,
            out_dir,
            calib=calib,
            calib_tokens=calib_tokens,
            seq_len=seq_len,
            image_size=DEFAULT_IMAGE_SIZE,
            eval_data=eval_data,
            eval_tokens=eval_tokens,
            overwrite=overwrite,
            progress=True,
            resume=resume,
        )
    return report, time.monotonic() - started


def run_and_summarise(
    recipe,
    model_dir: Path,
    out_dir: Path,
    *,
    overwrite: bool,
    resume: bool,
    before_work: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Check the recipe and the output, call ``before_work`` (announcements), run ``recipe``, then print where the
    output is and the summary table (stdout; under ``torchrun`` rank 0 alone prints)."""
    import dataclasses

    from ..calibration import distributed
    from ..runner.recipes import check_recipe, run_recipe
    from ..runner.summary import format_table
    from .common_options import chosen_device, refuse_unused_common

    refuse_unused_common(recipe.passes, recipe.evaluation is not None, recipe.calibration.source)
    if chosen_device() is not None:
        recipe = dataclasses.replace(recipe, device=chosen_device())
    check_before_work(out_dir, model_dir, overwrite=overwrite, resume=resume)
    check_recipe(recipe, model_dir)
    start_over_if_asked(out_dir)
    if before_work is not None:
        before_work()
    started = time.monotonic()
    report = run_recipe(recipe, model_dir, out_dir, overwrite=overwrite, resume=resume, progress=True)
    seconds = time.monotonic() - started
    if not distributed.is_writer():
        return report
    progress.event(
        "summary",
        f"wrote {out_dir} in {seconds:.1f}s",
        out=str(out_dir),
        seconds=round(seconds, 2),
        outcome=report["outcome"],
        only_json=True,
    )
    click.echo(f"wrote {out_dir} in {seconds:.1f}s")
    click.echo(format_table(report["outcome"]))
    return report
