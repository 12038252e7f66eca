"""``moecompress export``: a moecompress output as a GGUF file for llama.cpp, or as a plain bf16 checkpoint."""

from __future__ import annotations

import os
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
    "k-quant blocks (Q4_0/Q5_0/Q5_1/Q8_0 at widths not a multiple of 256) (exact), integer experts as Q4_0/Q4_1 "
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
    help="gguf: fold low-rank adapters and salient weights into dense bf16 expert tensors for the layers that "
    "have them, in one file (without it adapters go to a LoRA file and salient weights are refused).",
)
@click.option(
    "--lora-out",
    "lora_out",
    default=None,
    type=click.Path(path_type=Path),
    help="gguf, an output with low-rank adapters: the llama.cpp LoRA adapter file for them, used as "
    "`llama-cli -m OUT --lora FILE` (default: OUT with .gguf replaced by .lora.gguf).",
)
@overwrite_option("Replace an existing output.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def export_command(
    model: str,
    fmt: str,
    out: Path,
    llama_cpp: str | None,
    fold: bool,
    lora_out: Path | None,
    overwrite: bool,
    quiet: bool,
) -> None:
    """Export MODEL (a moecompress output, or any checkpoint llama.cpp's converter reads) for other tools.

    gguf refuses global-scope pruned outputs (layers with different expert counts; prune with --scope layer)
    and, without --fold, outputs with salient weights; low-rank adapters go to a llama.cpp LoRA file beside the
    GGUF (--lora-out) unless --fold puts them in the GGUF. The report, with the measured
    difference between GGML's values and ours for every expert tensor, is written beside the file as
    FILE.report.json (for bf16: moecompress_export.json inside the directory).
    """
    from .. import run_lock
    from ..checkpoint import resolve_model
    from ..errors import UserInputError
    from ..preflight import check_not_in_inputs

    source = resolve_model(model)
    check_not_in_inputs(out, [source], f"--out {out}")
    if lora_out is not None:
        check_not_in_inputs(lora_out, [source], f"--lora-out {lora_out}")
    run_lock.acquire(out, label=f"--out {out}")
    click.get_current_context().call_on_close(lambda: run_lock.release(out))
    if fmt == "gguf":
        from ..export.to_gguf import export_gguf, report_path

        report = export_gguf(
            source, out, llama_cpp=llama_cpp, fold=fold, lora_out=lora_out, overwrite=overwrite, progress=not quiet
        )
        experts = report["experts"]
        kinds = experts["written_as"]
        line = f"wrote {out} ({_human_bytes(report['bytes'])})"
        if isinstance(kinds, list):
            exact = "exact" if experts["all_exact"] else "within the stated bounds, see the report"
            line += f"; experts as {', '.join(kinds) or 'bf16 (folded)'} ({exact})"
        click.echo(line)
        lora = report.get("lora")
        if lora:
            click.echo(
                f"wrote {lora['path']} ({_human_bytes(lora['bytes'])}): the low-rank adapters of "
                f"{len(lora['tensors'])} expert tensors as a llama.cpp LoRA; run with -m {out} --lora {lora['path']}"
            )
        click.echo(f"report: {report_path(Path(os.path.abspath(out)))}")
        return
    if llama_cpp is not None or fold or lora_out is not None:
        raise UserInputError(
            "--llama-cpp, --fold and --lora-out apply to --format gguf only (bf16 always folds adapters)"
        )
    from ..export.to_bf16 import export_bf16

    report = export_bf16(source, out, overwrite=overwrite, progress=not quiet)
    folded = report["folded"]["layers"]
    click.echo(f"wrote {out}" + (f" (adapters folded in {len(folded)} layers)" if folded else ""))
