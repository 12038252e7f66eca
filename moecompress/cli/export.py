"""``moecompress export``: a moecompress output as a GGUF file for llama.cpp, or as a plain bf16 checkpoint."""

from __future__ import annotations

from pathlib import Path

import click

from .common_options import overwrite_option
from .numbers import human_bytes as _human_bytes


@click.command("export")
@click.argument("model")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["gguf", "bf16"]),
    required=True,
    help="gguf: one .gguf file for llama.cpp, MXFP4 experts as GGML MXFP4 and q2_k..q6_k experts as GGML's own "
    "k-quant blocks (IQ4_NL/Q5_0/Q5_1/Q8_0 at widths not a multiple of 256) (exact), integer experts as Q4_0/Q4_1 "
    "(error measured), the rest written by llama.cpp's own converter. bf16: a plain dequantised Hugging Face "
    "checkpoint (adapters folded in).",
)
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The .gguf file, or the bf16 directory.")
@click.option(
    "--llama-cpp",
    "llama_cpp",
    default=None,
    help="gguf: a llama.cpp checkout or an unpacked llama-cpp-python sdist holding convert_hf_to_gguf.py "
    "(default: $MOECOMPRESS_LLAMA_CPP).",
)
@click.option(
    "--fold",
    is_flag=True,
    help="gguf: fold low-rank adapters and salient weights, which GGML cannot express, into dense bf16 expert "
    "tensors for the layers that have them (without it such outputs are refused).",
)
@overwrite_option("Replace an existing output.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def export_command(
    model: str, fmt: str, out: Path, llama_cpp: str | None, fold: bool, overwrite: bool, quiet: bool
) -> None:
    """Export MODEL (a moecompress output, or any checkpoint llama.cpp's converter reads) for other tools.

    gguf refuses global-scope pruned outputs (layers with different expert counts; prune with --scope layer)
    and, without --fold, outputs with low-rank adapters or salient weights. The report, with the measured
    difference between GGML's values and ours for every expert tensor, is written beside the file as
    FILE.report.json (for bf16: moecompress_export.json inside the directory).
    """
    from .. import run_lock
    from ..checkpoint import resolve_model
    from ..errors import UserInputError
    from ..preflight import check_not_in_inputs

    source = resolve_model(model)
    check_not_in_inputs(out, [source], f"--out {out}")
    run_lock.acquire(out, label=f"--out {out}")
    click.get_current_context().call_on_close(lambda: run_lock.release(out))
    if fmt == "gguf":
        from ..export.to_gguf import export_gguf, report_path

        report = export_gguf(source, out, llama_cpp=llama_cpp, fold=fold, overwrite=overwrite, progress=not quiet)
        experts = report["experts"]
        kinds = experts["written_as"]
        line = f"wrote {out} ({_human_bytes(report['bytes'])})"
        if isinstance(kinds, list):
            exact = "exact" if experts["all_exact"] else "within the stated bounds, see the report"
            line += f"; experts as {', '.join(kinds) or 'bf16 (folded)'} ({exact})"
        click.echo(line)
        click.echo(f"report: {report_path(out.absolute())}")
        return
    if llama_cpp is not None or fold:
        raise UserInputError("--llama-cpp and --fold apply to --format gguf only (bf16 always folds adapters)")
    from ..export.to_bf16 import export_bf16

    report = export_bf16(source, out, overwrite=overwrite, progress=not quiet)
    folded = report["folded"]["layers"]
    click.echo(f"wrote {out}" + (f" (adapters folded in {len(folded)} layers)" if folded else ""))
