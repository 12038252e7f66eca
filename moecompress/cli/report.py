"""``moecompress report``: reprint the summary table of finished runs, and plot them against each other."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("report")
@click.argument("directories", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also draw perplexity against weight bytes for every DIRECTORY given, into this PNG.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the outcomes as JSON instead of tables.")
def report_command(directories: tuple[Path, ...], plot_path: Path | None, as_json: bool) -> None:
    """Print the summary table of each output DIRECTORY (from its moecompress_report.json).

    Runs made by `run`, `prune` or `quantize` carry their table's figures; for other outputs the figures are
    measured from the output and the source model named in the report, when that is still at hand.
    """
    from ..errors import UserInputError
    from ..runner.preflight import check_file_target, check_not_in_inputs
    from ..runner.summary import format_table, load_report, outcome_of, plot_runs

    if plot_path is not None:
        check_not_in_inputs(plot_path, list(directories), f"--plot {plot_path}")
        check_file_target(plot_path, f"--plot {plot_path}")
    runs = []
    for directory in directories:
        if not directory.is_dir():
            raise UserInputError(f"{directory}: no such directory")
        report = load_report(directory)
        runs.append((directory.name, outcome_of(directory, report), report))
    if as_json:
        click.echo(
            json.dumps({str(d): outcome for d, (_, outcome, _) in zip(directories, runs, strict=True)}, indent=2)
        )
    else:
        for index, (_, outcome, report) in enumerate(runs):
            if index:
                click.echo("")
            passes = report.get("recipe", {}).get("passes") or [report.get("pass", "?")]
            click.echo(f"{directories[index]}: {'; '.join(passes)}")
            click.echo(format_table(outcome))
    if plot_path is not None:
        plot_runs([(name, outcome) for name, outcome, _ in runs], plot_path)
        click.echo(f"plotted {len(runs)} run(s) to {plot_path}")
