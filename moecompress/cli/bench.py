"""``moecompress bench``: speed benchmarks; ``bench kernels`` times the Triton kernels against torch bf16."""

from __future__ import annotations

from pathlib import Path

import click

from .pass_options import FiniteFloat


@click.group("bench")
def bench_group() -> None:
    """Speed benchmarks."""


@bench_group.command("kernels")
@click.option(
    "--json-out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write every figure to this JSON file.",
)
@click.option("--quick", is_flag=True, help="Tiny shapes and two repetitions: a smoke test, not a measurement.")
@click.option(
    "--repeats", type=click.IntRange(min=1), default=None, help="Timed calls per case (default 20 on a GPU, 3 on CPU)."
)
@click.option(
    "--hbm-gbs",
    type=FiniteFloat(min=0, min_open=True),
    default=None,
    help="HBM bandwidth in GB/s for the %HBM columns (default: 4800 on an H200, else no column).",
)
def kernels_command(json_out: Path | None, quick: bool, repeats: int | None, hbm_gbs: float | None) -> None:
    """Time each kernel against torch bf16 at decode (1, 4, 16 tokens) and prefill (2048) shapes of
    Qwen3-30B-A3B and Mixtral-8x7B layers, and the Golomb-Rice decoder at 1% and 5% density.

    Prints median ms, GB/s on weight bytes, TFLOP/s and the speed-up over bf16, and on a GPU the issue #9
    goals met or not. Without a GPU it times the torch references on CPU at reduced sizes instead.
    """
    from ..errors import UserInputError
    from ..files import write_json

    if json_out is not None and not json_out.parent.is_dir():
        raise UserInputError(f"{json_out}: its directory does not exist")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise UserInputError("the kernel benchmark needs triton (pip install 'moecompress[triton]')") from None
    from ..kernels.bench import format_report, run_benchmark

    result = run_benchmark(quick=quick, repeats=repeats, hbm_gbs=hbm_gbs, progress=lambda m: click.echo(m, err=True))
    if json_out is not None:
        write_json(json_out, result.to_json())
    click.echo(format_report(result))
    if json_out is not None:
        click.echo(f"wrote {json_out}")
