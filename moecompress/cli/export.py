"""``moecompress export``: a moecompress output as a GGUF file for llama.cpp, or as a plain bf16 checkpoint."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click

from ..export.gguf_types import CHOICES, ENCODED
from .common_options import overwrite_option
from .numbers import human_bytes as _human_bytes


@dataclass(frozen=True)
class _Options:
    """The command's options besides the model and ``--out`` (most of them ``gguf``'s)."""

    llama_cpp: str | None
    fold: bool
    lora_out: Path | None
    target_size: str | None
    target_bpw: float | None
    imatrix: Path | None
    tensor_types: tuple[str, ...]
    base_type: str
    overwrite: bool
    quiet: bool


def _export_gguf(source: Path, out: Path, options: _Options) -> None:
    """One .gguf file for llama.cpp, and its report beside it."""
    from ..errors import UserInputError
    from ..export.gguf_retype import Request
    from ..export.gguf_types import parse_pins, parse_size
    from ..export.to_gguf import export_gguf, report_path

    if options.target_size is not None and options.target_bpw is not None:
        raise UserInputError("--target-size and --target-bpw: give one budget, not both")
    types = Request(
        pins=parse_pins(options.tensor_types),
        default_type=options.base_type,
        target_bytes=None if options.target_size is None else parse_size(options.target_size),
        target_bpw=options.target_bpw,
        imatrix=None if options.imatrix is None else Path(os.path.abspath(options.imatrix)),
    )
    report = export_gguf(
        source,
        out,
        llama_cpp=options.llama_cpp,
        fold=options.fold,
        lora_out=options.lora_out,
        overwrite=options.overwrite,
        types=types,
        progress=not options.quiet,
    )
    experts = report["experts"]
    kinds = experts["written_as"]
    line = f"wrote {out} ({_human_bytes(report['bytes'])})"
    if isinstance(kinds, list):
        exact = "exact" if experts["all_exact"] else "within the stated bounds, see the report"
        line += f"; experts as {', '.join(kinds) or 'bf16 (folded)'} ({exact})"
    click.echo(line)
    retyped = report.get("tensor_types")
    if retyped:
        counts: dict[str, int] = {}
        for entry in retyped["tensors"].values():
            counts[entry["type"]] = counts.get(entry["type"], 0) + 1
        kinds_line = ", ".join(f"{count} {kind}" for kind, count in sorted(counts.items()))
        click.echo(f"other tensors: {kinds_line}" + (" (allocated to the budget)" if "spent" in retyped else ""))
    lora = report.get("lora")
    if lora:
        click.echo(
            f"wrote {lora['path']} ({_human_bytes(lora['bytes'])}): the low-rank adapters of "
            f"{len(lora['tensors'])} expert tensors as a llama.cpp LoRA; run with -m {out} --lora {lora['path']}"
        )
    click.echo(f"report: {report_path(Path(os.path.abspath(out)))}")


def _export_bf16(source: Path, out: Path, options: _Options) -> None:
    """A plain dequantised Hugging Face checkpoint, adapters folded in."""
    from ..errors import UserInputError
    from ..export.to_bf16 import export_bf16

    gguf_only = [
        options.target_size,
        options.target_bpw,
        options.imatrix,
        options.tensor_types or None,
        None if options.base_type == "Q8_0" else options.base_type,
    ]
    if (
        options.llama_cpp is not None
        or options.fold
        or options.lora_out is not None
        or any(value is not None for value in gguf_only)
    ):
        raise UserInputError(
            "--llama-cpp, --fold, --lora-out, --target-size, --target-bpw, --imatrix, --tensor-type and --base-type "
            "apply to --format gguf only (bf16 always folds adapters)"
        )
    report = export_bf16(source, out, overwrite=options.overwrite, progress=not options.quiet)
    folded = report["folded"]["layers"]
    click.echo(f"wrote {out}" + (f" (adapters folded in {len(folded)} layers)" if folded else ""))


EXPORT_FORMATS: dict[str, Callable[..., None]] = {"gguf": _export_gguf, "bf16": _export_bf16}
"""``--format``'s choices: each writes its export from the command's options (the options of another format
refused in one line)."""


@click.command("export")
@click.argument("model")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(list(EXPORT_FORMATS)),
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
@click.option(
    "--target-size",
    "target_size",
    default=None,
    help="gguf: the largest file size, in bytes or as 5.2MB / 17GiB: every tensor llama-quantize would quantise "
    f"(and that no --tensor-type pins) gets the GGML type among {', '.join(CHOICES)} that makes the summed "
    "importance-weighted relative error smallest within it (the routed experts too when MODEL is unquantised; "
    "a moecompress output's expert blocks are kept and counted). The report and the GGUF key "
    "moecompress.tensor_types hold the allocation.",
)
@click.option(
    "--target-bpw",
    "target_bpw",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="gguf: like --target-size, as bits per weight over all the file's tensors (header not counted).",
)
@click.option(
    "--imatrix",
    "imatrix",
    default=None,
    type=click.Path(path_type=Path),
    help="gguf: a llama.cpp importance matrix (GGUF: `quantize --imatrix-out` or llama-imatrix) weighting each "
    "column's error by its inputs' mean square, per expert, in the encoding and in --target-size's choice; "
    "without it every column weighs 1.",
)
@click.option(
    "--tensor-type",
    "tensor_types",
    multiple=True,
    metavar="PATTERN=TYPE",
    help=f"gguf, repeatable: GGUF tensors whose name matches the regular expression PATTERN take TYPE "
    f"({', '.join(ENCODED)}, or keep: as the converter wrote it), e.g. "
    "'output\\.weight=Q6_K'; the first match wins. Widths llama.cpp's fallback rule covers take its fallback.",
)
@click.option(
    "--base-type",
    "base_type",
    type=click.Choice(ENCODED),
    default="Q8_0",
    show_default=True,
    help="gguf, without --target-size/--target-bpw: the type of a moecompress output's other quantisable tensors "
    "(attention, shared experts, dense MLPs, embeddings, head) that no --tensor-type pins.",
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
    target_size: str | None,
    target_bpw: float | None,
    imatrix: Path | None,
    tensor_types: tuple[str, ...],
    base_type: str,
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
    from ..checkpoint import resolve_model
    from ..runner import lock as run_lock
    from ..runner.preflight import check_not_in_inputs

    source = resolve_model(model)
    check_not_in_inputs(out, [source], f"--out {out}")
    if lora_out is not None:
        check_not_in_inputs(lora_out, [source], f"--lora-out {lora_out}")
    run_lock.acquire(out, label=f"--out {out}")
    click.get_current_context().call_on_close(lambda: run_lock.release(out))
    options = _Options(
        llama_cpp=llama_cpp,
        fold=fold,
        lora_out=lora_out,
        target_size=target_size,
        target_bpw=target_bpw,
        imatrix=imatrix,
        tensor_types=tensor_types,
        base_type=base_type,
        overwrite=overwrite,
        quiet=quiet,
    )
    EXPORT_FORMATS[fmt](source, out, options)
