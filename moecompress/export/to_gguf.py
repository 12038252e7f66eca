"""``--format gguf``: a GGUF file for llama.cpp that keeps our quantised experts.

llama.cpp's own converter writes the metadata, vocabulary and every non-expert tensor, from a view of the
checkpoint (:mod:`.view`: unquantised per-expert layout, bf16 where we dequantise) in which the routed experts are
holes, never decoded nor written; those are then filled with our codes re-packed as GGML blocks
(:mod:`.ggml_blocks`): MXFP4 and GGML's k-quants (with their fallback types) exactly, integer grids as Q4_0 / Q4_1
with the error measured. A routed-expert scheme with no GGML block type is refused before any work. Low-rank
adapters go to a llama.cpp LoRA adapter file beside the GGUF (:mod:`.gguf_lora`), whose experts are then written
as for the same checkpoint without adapters. Salient weights have no GGML form: they are refused, or with ``fold``
written folded (adapters too) into dense bf16. A checkpoint that is not in our native format (an original or
pruned bf16 model, our gpt-oss export) goes to the converter as it is.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import CheckpointReader
from ..errors import OptionError, UserInputError
from ..families import FamilyAdapter, adapter_for
from ..files import DiskFullError, is_full, write_json
from ..memory import release_freed_memory
from ..progress import bar as progress_bar
from ..quantization.scheme import QuantizedTensor, QuantScheme
from ..vocabulary import named
from . import ggml_blocks, gguf_lora
from .gguf_retype import KeptBlocks, Request, Retyper
from .gguf_types import Pin
from .llama_cpp import find_converter, run_converter
from .source import NativeSource, check_exportable, fold, quant_config
from .to_bf16 import dense_layer, fold_error, open_native, plain_config
from .view import ConverterView

FILE_TYPES = {
    "MXFP4": "MOSTLY_MXFP4_MOE",
    "Q4_0": "MOSTLY_Q4_0",
    "Q4_1": "MOSTLY_Q4_1",
    "Q2_K": "MOSTLY_Q2_K",
    "Q3_K": "MOSTLY_Q3_K_S",
    "Q4_K": "MOSTLY_Q4_K_S",
    "Q5_K": "MOSTLY_Q5_K_S",
    "Q6_K": "MOSTLY_Q6_K",
    "IQ4_NL": "MOSTLY_IQ4_NL",
    "Q5_0": "MOSTLY_Q5_0",
    "Q5_1": "MOSTLY_Q5_1",
    "Q8_0": "MOSTLY_Q8_0",
}
"""``general.file_type`` per expert block type. A k-quant file takes the ``_S`` type: ours has the one k-quant in
every expert (llama.cpp's ``_M``/``_L`` mixes raise some ``ffn_down`` and ``attn_v`` to wider types)."""
_STORED_EXACT = "exact: GGML's own block fields as stored, joined in GGML's block order"
BOUNDS = {
    **{kind: _STORED_EXACT for kind in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "Q5_0", "Q5_1", "Q8_0")},
    "MXFP4": "exact: same E2M1 codes and E8M0 scale byte",
    "Q4_0": "integer experts: |ggml - ours| <= 2^-8 |ours| (our bf16 rounding of (q-8)*s; the scale converts to "
    "fp16 exactly when it lies in fp16's normal range); q2_k/q3_k's fallback at widths not a multiple of 256: "
    + _STORED_EXACT,
    "Q4_1": "|ggml - ours| <= 2^-8 |ours| + 2^-11 |z*s| (our bf16 rounding, and fp16 rounding of m = -z*s)",
}


def report_path(out: Path) -> Path:
    return out.with_name(out.name + ".report.json")


def check_scope(adapter: FamilyAdapter, source: Path) -> None:
    """GGUF holds one routed-expert count per model; global-scope pruning leaves layers with different counts."""
    counts = {adapter.experts_in_layer(layer) for layer in adapter.moe_layers()}
    if len(counts) > 1 or (counts and counts != {adapter.num_experts}):
        raise OptionError(
            f"{source}: routed experts per layer differ ({min(counts)} to {max(counts)}, global-scope pruning); "
            f"GGUF and llama.cpp hold one expert count per model: prune with {named('scope', 'layer')}"
        )


def check_one_activation(adapter: FamilyAdapter, source: Path) -> None:
    """llama.cpp's converter writes one expert activation per model; a clamp limit per layer would be lost."""
    if adapter.activation_varies():
        raise OptionError(
            f"{source}: {adapter.family}'s experts clamp their SwiGLU with a limit per layer, which the GGUF export "
            f"(llama.cpp's converter) does not write; export {named('format', 'gguf')} is not supported for it"
        )


def check_foldable(config: dict[str, Any], source: Path, fold: bool) -> list[str]:
    """What is folded (``lowrank``, ``salient``): with ``fold`` all there is; without it nothing, and salient
    weights are refused (adapters go to the LoRA file)."""
    qc = quant_config(config) or {}
    needs = [name for name in ("lowrank", "salient") if qc.get(name)]
    if "salient" in needs and not fold:
        raise OptionError(
            f"{source}: has salient weights, which GGML cannot express; pass {named('fold')} to fold them into "
            "dense bf16 expert tensors for the layers that have them (those lose their 4-bit form), or quantize "
            "without them"
        )
    return needs if fold else []


def lora_path(
    config: dict[str, Any], source: Path, out: Path, fold: bool, lora_out: Path | None, overwrite: bool
) -> Path | None:
    """Where the adapters' LoRA file goes: the checkpoint has low-rank adapters and ``fold`` is not given."""
    lowrank = bool((quant_config(config) or {}).get("lowrank"))
    if lora_out is not None and (fold or not lowrank):
        why = f"{named('fold')} folds the adapters into the GGUF" if fold else f"{source} has no low-rank adapters"
        raise OptionError(f"{named('lora_out', lora_out)}: {why}")
    if not lowrank or fold:
        return None
    path = gguf_lora.default_path(out) if lora_out is None else Path(os.path.abspath(lora_out))
    if path == out:
        raise OptionError(f"{named('lora_out', lora_out)}: is the base GGUF {named('run.out')}")
    if path.is_dir():
        raise UserInputError(f"{path}: is a directory; the LoRA adapters are one file")
    if path.exists() and not overwrite:
        raise OptionError(f"{path}: exists (pass {named('run.overwrite', True)} to replace it)")
    return path


def _gguf_name(layer: int, matrix: str) -> str:
    return f"blk.{layer}.ffn_{matrix}_exps.weight"


def _names(layer: str, matrices: list[str]) -> list[str]:
    """The GGUF names of a layer's folded expert matrices (``gate_up`` is two)."""
    parts = [part for matrix in matrices for part in (("gate", "up") if matrix == "gate_up" else (matrix,))]
    return [_gguf_name(int(layer), part) for part in parts]


def _hole_shapes(moe, folded: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...]]]:
    """The expert matrices written as GGML blocks (those not folded) with their logical shapes."""
    gate_up, down, inter = tuple(moe.gate_up.shape), tuple(moe.down.shape), moe.intermediate_size
    out = []
    if "gate_up" not in folded:
        out += [("gate", (*gate_up[:-2], inter, gate_up[-1])), ("up", (*gate_up[:-2], inter, gate_up[-1]))]
    if "down" not in folded:
        out.append(("down", down))
    return out


def _write_view(
    native: NativeSource, source: Path, view: Path, folding: bool, kept: KeptBlocks, progress: bool
) -> dict[str, Any]:
    """The converter's view of the checkpoint (:mod:`.view`): our expert blocks' places are holes, and only layers
    that need folding (when ``folding``) have their experts read and decoded; the blocks of quantised dense tensors
    go to ``kept``. Returns the holes (GGUF name -> GGML type and the blocks' byte shape), the folded matrices per
    layer and their largest bf16 rounding error."""
    writer = ConverterView(view)
    native.on_dense_quantized = kept.add
    holes: dict[str, tuple[str, tuple[int, ...]]] = {}
    folded_layers: dict[str, list[str]] = {}
    worst = 0.0
    writer.add(native.outside_tensors())
    for index in progress_bar(list(native.layers), desc="converter's view", unit="layer", disable=not progress):
        needs = folding and native.needs_fold(index)
        layer = native.layer(index, experts_read=needs)
        folded = fold(layer) if needs else {}
        experts = native.quantized_experts_module(index)
        if experts is not None:
            if folded:
                folded_layers[str(index)] = sorted(folded)
                worst = max(worst, fold_error(folded))
            scheme = native.expert_scheme(experts)
            for matrix, shape in _hole_shapes(layer.moe, folded):
                param = "down_proj" if matrix == "down" else "gate_up_proj"
                kind = ggml_blocks.ggml_type(scheme, native.has_zeros(experts, param), shape[-1])
                holes[_gguf_name(index, matrix)] = (kind, ggml_blocks.byte_shape(kind, shape))
        writer.add(dense_layer(native.adapter, layer, folded))
        del layer, folded
        release_freed_memory()
    writer.finish(plain_config(native.reader.config), source)
    return {"holes": holes, "folded": folded_layers, "worst": worst}


def _hole_offsets(
    partial: Path, holes: dict[str, tuple[str, tuple[int, ...]]], noted: dict[str, int]
) -> dict[str, int]:
    """Where each hole's bytes start in the converter's file: as the converter driver noted them while writing, or
    else (a hole it did not write straight into the file) from the file's tensor table, after checking each hole's
    type and size there."""
    size = partial.stat().st_size
    if set(noted) >= set(holes):
        offsets = {name: int(noted[name]) for name in holes}
        for name, offset in offsets.items():
            if offset + math.prod(holes[name][1]) > size:
                raise RuntimeError(f"{partial}: {name} ends past the end of the file")
        return offsets
    import gguf

    found = {tensor.name: tensor for tensor in gguf.GGUFReader(partial).tensors}
    offsets = {}
    for name, (kind, shape) in holes.items():
        tensor = found.get(name)
        if tensor is None:
            raise RuntimeError(f"the converter did not write {name}")
        if tensor.tensor_type.name != kind or tensor.n_bytes != math.prod(shape):
            raise RuntimeError(f"{partial}: {name} is {tensor.tensor_type.name} of {tensor.n_bytes} bytes, not {kind}")
        offsets[name] = int(tensor.data_offset)
    return offsets


def _fill_blocks(
    native: NativeSource,
    partial: Path,
    holes: dict[str, tuple[str, tuple[int, ...]]],
    noted: dict[str, int],
    progress: bool,
) -> dict[str, dict[str, Any]]:
    """Our experts' GGML blocks written into their holes, one tensor at a time, re-packed a few rows at a time from
    the memory-mapped source straight into the file; returns each tensor's error entry."""
    offsets = _hole_offsets(partial, holes, noted)
    layers = [index for index in native.layers if native.quantized_experts_module(index) is not None]
    errors: dict[str, dict[str, Any]] = {}
    with open(partial, "r+b", buffering=0) as handle:
        for index in progress_bar(layers, desc="expert blocks", unit="layer", disable=not progress):
            gate_up_q, down_q = native.quantized_experts(index)
            inter = gate_up_q.shape[-2] // 2
            halves = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}
            for matrix in ("gate", "up", "down"):
                name = _gguf_name(index, matrix)
                if name not in holes:
                    continue
                q = down_q if matrix == "down" else _rows(gate_up_q, halves[matrix])
                kind = ggml_blocks.ggml_type_for(q)
                shape = ggml_blocks.byte_shape(kind, tuple(q.shape))
                if (kind, shape) != holes[name]:
                    raise RuntimeError(f"{name}: blocks of {kind} {shape}, not {holes[name]}")
                offset = offsets[name]
                for chunk in ggml_blocks.ggml_chunks(q):
                    _write_at(handle.fileno(), chunk, offset)
                    offset += chunk.nbytes
                if offset - offsets[name] != math.prod(shape):
                    raise RuntimeError(f"{name}: {offset - offsets[name]} bytes of blocks, not {math.prod(shape)}")
                errors[name] = {"type": kind, **ggml_blocks.measure(q).to_dict()}
            del gate_up_q, down_q
    return errors


def _rows(q: QuantizedTensor, rows: slice) -> QuantizedTensor:
    """Rows ``rows`` of the output dimension as views (``take_rows`` copies them)."""

    def pick(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor[..., rows, :]

    shape = (*q.shape[:-2], rows.stop - rows.start, q.shape[-1])
    return replace(q, shape=shape, packed=pick(q.packed), scales=pick(q.scales), zeros=pick(q.zeros))


def _write_at(fd: int, array: np.ndarray, offset: int) -> None:
    view = memoryview(np.ascontiguousarray(array).view(np.uint8)).cast("B")
    while view:
        count = os.pwrite(fd, view, offset)
        view, offset = view[count:], offset + count


def source_outtype(reader: CheckpointReader) -> str:
    """The converter's ``--outtype`` that keeps the source's unquantised weights as they are: the widest float
    dtype among its 2-D and larger ``.weight`` tensors (quantised ones are stored as integers)."""
    dtypes = {info.dtype for key, info in reader.tensors.items() if key.endswith(".weight") and len(info.shape) >= 2}
    for name, outtype in (("F32", "f32"), ("F16", "f16")):
        if name in dtypes:
            return outtype
    return "bf16"


def native_schemes(config: dict[str, Any]) -> list[QuantScheme]:
    return [QuantScheme.from_dict(value) for value in (quant_config(config) or {}).get("schemes", {}).values()]


def _file_type(types: dict[str, str], schemes: set[QuantScheme]) -> str | None:
    """One expert block type: its file type. Several, written by one scheme: the one super-block type among them
    (a k-quant, with its 32-weight fallback at other widths). Otherwise none: the converter's own."""
    kinds = set(types.values())
    if len(kinds) == 1:
        return FILE_TYPES.get(kinds.pop())
    wide = [kind for kind in kinds if ggml_blocks.BLOCKS[kind][0] > ggml_blocks.QK]
    return FILE_TYPES.get(wide[0]) if len(schemes) == 1 and len(wide) == 1 else None


def check_ggml_form(native: NativeSource, source: Path) -> None:
    """Every quantised routed-expert matrix has a GGML block type (read from the stored shapes, nothing decoded)."""
    for index in native.layers:
        experts = native.quantized_experts_module(index)
        if experts is None:
            continue
        scheme = native.expert_scheme(experts)
        for param in ("gate_up_proj", "down_proj"):
            cols = native.logical_shape(experts, param)[-1]
            if scheme.kind.ggml_block_type(scheme, native.has_zeros(experts, param), cols) is None:
                raise OptionError(
                    f"{source}: the routed experts' scheme {scheme.name} has no GGML block type (GGUF holds "
                    f"mxfp4, int4/int2/binary/w4a8 as Q4_0/Q4_1, and q2_k..q6_k); export {named('format', 'bf16')} "
                    "instead"
                )


def _export_native(
    source: Path,
    converter: Path,
    partial: Path,
    work: Path,
    config: dict[str, Any],
    outtype: str,
    needs: list[str],
    lora: tuple[Path, list[gguf_lora.LoraTensor]] | None,
    kept: KeptBlocks,
    progress: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A native-format checkpoint: the converter writes everything but our expert blocks, from a view of the
    checkpoint in which their places are holes; then our blocks fill them, and the planned adapters go to the
    (partial) LoRA file where ``lora`` gives one. Returns the converter driver's result and the report's entries."""
    report: dict[str, Any] = {}
    reader, native = open_native(source)
    with reader:
        plan = _write_view(native, source, work / "view", bool(needs), kept, progress)
        holes = plan["holes"]
        types = {name: kind for name, (kind, _) in holes.items()}
        modules = {native.quantized_experts_module(index) for index in native.layers} - {None}
        file_type = _file_type(types, {native.expert_scheme(experts) for experts in modules})
        done = run_converter(converter, work / "view", partial, outtype=outtype, holes=holes, file_type=file_type)
        missing = sorted(set(holes) - set(done["substituted"]))
        if missing:
            raise RuntimeError(f"the converter did not write {missing[0]}")
        errors = _fill_blocks(native, partial, holes, done.get("hole_offsets", {}), progress)
        if lora is not None:
            import gguf

            path, tensors = lora
            outside = sorted({entry.base for entry in tensors} - set(holes))
            if outside:
                raise RuntimeError(f"{outside[0]} has adapters but is not one of the GGUF's expert block tensors")
            arch = gguf.GGUFReader(partial).fields["general.architecture"].contents()
            report["lora"] = gguf_lora.write_lora(native, tensors, arch, path, progress)
    report["experts"] = {
        "written_as": sorted(set(types.values())),
        "file_type": file_type,
        "bounds": {kind: BOUNDS[kind] for kind in sorted(set(types.values()))},
        "tensors": errors,
        "all_exact": all(entry["exact"] for entry in errors.values()),
    }
    if any(scheme.activation_bits for scheme in native_schemes(config)):
        report["experts"]["activations"] = (
            "W4A8: the weights are Q4_0; llama.cpp quantises activations its own way (Q8_0 blocks of 32 on "
            "CPU), not per token as our W4A8 does"
        )
    report["folded"] = {
        "what": needs,
        "layers": plan["folded"],
        "how": f"folded matrices are written dense, not as GGML blocks: W_deq + L·R rounded to bf16, stored "
        f"as the converter's --outtype {outtype}",
        "max_abs_rounding_error": plan["worst"],
    }
    report["other_tensors"] = (
        f"written by the converter (--outtype {outtype}) from the dequantised view, then each tensor llama-quantize "
        "would quantise encoded in the GGML type tensor_types gives it"
    )
    return done, report


def _retype(partial: Path, request: Request, kept: KeptBlocks, progress: bool) -> dict[str, Any]:
    """The converter's file re-written with every tensor in its GGML type (:mod:`.gguf_retype`), in its place."""
    retyped = partial.with_name(partial.name + ".retyped")
    try:
        retyper = Retyper(partial, request, kept)
        allocation = retyper.plan(progress)
        if retyper.changes:
            details = retyper.write(retyped, progress)
            del retyper
            os.replace(retyped, partial)
        else:
            details = retyper.report()
    finally:
        retyped.unlink(missing_ok=True)
    size = partial.stat().st_size
    if request.target_bytes is not None and size > request.target_bytes:
        raise RuntimeError(f"the GGUF is {size} bytes, over the target size of {request.target_bytes} bytes")
    return {
        "request": {
            "target_bytes": request.target_bytes,
            "target_bpw": request.target_bpw,
            "imatrix": None if request.imatrix is None else str(request.imatrix),
            "pins": [f"{pin.pattern.pattern}={pin.type_name}" for pin in request.pins],
            "default_type": request.default_type,
        },
        **allocation,
        **details,
    }


def export_gguf(
    source: Path,
    out: Path,
    *,
    llama_cpp: str | os.PathLike[str] | None = None,
    fold: bool = False,
    lora_out: Path | None = None,
    overwrite: bool = False,
    types: Request | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Write ``out`` (a .gguf file) and ``out.report.json``, and for a checkpoint with low-rank adapters (without
    ``fold``) the LoRA adapter file ``lora_out`` (default ``<out stem>.lora.gguf``); returns the report.

    ``types`` says which GGML type every other tensor takes (:mod:`.gguf_retype`): for a moecompress output the
    default is :class:`Request`'s; for a plain checkpoint the converter's types are kept unless ``types`` pins some
    or sets a budget."""
    out = Path(out).absolute()
    if out.exists() and not overwrite:
        raise OptionError(f"{out}: exists (pass {named('run.overwrite', True)} to replace it)")
    if out.is_dir():
        raise OptionError(f"{out}: is a directory; {named('format', 'gguf')} writes one file")
    if types is not None and types.imatrix is not None and not types.imatrix.is_file():
        raise OptionError(f"{named('imatrix', types.imatrix)}: no such file")
    with CheckpointReader(source) as reader:
        config = reader.config
        outtype = source_outtype(reader)
        adapter = adapter_for(config, source=str(source))
        check_scope(adapter, source)
        check_one_activation(adapter, source)
        native = quant_config(config) is not None
        needs = check_foldable(config, source, fold) if native else []
        lora = lora_path(config, source, out, fold, lora_out, overwrite)
        if native:
            check_exportable(adapter)
            check_ggml_form(NativeSource(reader, adapter), source)
            lora_tensors = gguf_lora.plan(NativeSource(reader, adapter), source) if lora is not None else []
    retype = types if types is not None else (Request() if native else None)
    if retype is not None and not native and not (retype.budgeted or retype.pins):
        if retype.imatrix is not None:
            raise OptionError(
                f"{named('imatrix', retype.imatrix)}: a plain checkpoint keeps the converter's types unless "
                f"{named('target_size')}, {named('target_bpw')} or {named('tensor_type')} asks for others"
            )
        retype = None
    converter = find_converter(llama_cpp)
    work = out.with_name(f".{out.name}.work")
    shutil.rmtree(work, ignore_errors=True)
    partial = out.with_name(f".{out.name}.partial")
    lora_partial = None if lora is None else lora.with_name(f".{lora.name}.partial")
    try:
        work.mkdir(parents=True)
        report: dict[str, Any] = {"format": "gguf", "source": str(source), "converter": str(converter)}
        kept = KeptBlocks(work / "blocks")
        if native:
            try:
                planned = None if lora_partial is None else (lora_partial, lora_tensors)
                done, details = _export_native(
                    source, converter, partial, work, config, outtype, needs, planned, kept, progress
                )
            except OSError as error:
                if is_full(error):  # the view and the blocks are written here, not by the converter
                    raise DiskFullError(str(out), error.errno) from error
                raise
            report.update(details)
        else:
            done = run_converter(converter, source, partial, outtype=outtype)
            method = (config.get("quantization_config") or {}).get("quant_method")
            report["experts"] = {
                "written_as": f"as llama.cpp's converter writes them (--outtype {outtype})"
                + (f"; the input's {method} quantisation is the converter's to handle" if method else "")
            }
        report["pre_tokenizer_fallback"] = done["pre_tokenizer_fallback"]
        if retype is not None:
            folded = [name for names in report.get("folded", {}).get("layers", {}).items() for name in _names(*names)]
            keep = [Pin(re.compile(f"^{re.escape(name)}$"), "keep") for name in folded]
            report["tensor_types"] = _retype(partial, replace(retype, pins=keep + retype.pins), kept, progress)
        if lora is not None and lora_partial is not None:
            os.replace(lora_partial, lora)
            report["lora"] = {"path": str(lora), "bytes": lora.stat().st_size, **report["lora"]}
        os.replace(partial, out)
        report["bytes"] = out.stat().st_size
        write_json(report_path(out), report)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)
        partial.unlink(missing_ok=True)
        if lora_partial is not None:
            lora_partial.unlink(missing_ok=True)
