"""``--format gguf``: a GGUF file for llama.cpp that keeps our quantised experts.

llama.cpp's own converter writes the metadata, vocabulary and every non-expert tensor, from a bf16 view of the
checkpoint (:mod:`.to_bf16`); the routed experts' tensors are replaced by our codes re-packed as GGML blocks
(:mod:`.ggml_blocks`): MXFP4 exactly, integer grids as Q4_0 / Q4_1 with the error measured. Matrices with
low-rank adapters or salient weights have no GGML block form: they are refused, or with ``fold`` written
folded into dense bf16. A checkpoint that is not in our native format (an original or pruned bf16 model, our
gpt-oss export) goes to the converter as it is.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointReader, CheckpointWriter
from ..errors import UserInputError
from ..families import FamilyAdapter, adapter_for
from ..files import write_json
from ..quantization.scheme import QuantScheme
from . import ggml_blocks
from .llama_cpp import find_converter, run_converter
from .source import SourceLayer, check_exportable, quant_config
from .to_bf16 import export_bf16

FILE_TYPES = {"MXFP4": "MOSTLY_MXFP4_MOE", "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1"}
BOUNDS = {
    "MXFP4": "exact: same E2M1 codes and E8M0 scale byte",
    "Q4_0": "|ggml - ours| <= 2^-8 |ours| (our bf16 rounding of (q-8)*s; the scale converts to fp16 exactly "
    "when it lies in fp16's normal range)",
    "Q4_1": "|ggml - ours| <= 2^-8 |ours| + 2^-11 |z*s| (our bf16 rounding, and fp16 rounding of m = -z*s)",
}


def report_path(out: Path) -> Path:
    return out.with_name(out.name + ".report.json")


def check_scope(adapter: FamilyAdapter, source: Path) -> None:
    """GGUF holds one routed-expert count per model; global-scope pruning leaves layers with different counts."""
    counts = {adapter.experts_in_layer(layer) for layer in adapter.moe_layers()}
    if len(counts) > 1 or (counts and counts != {adapter.num_experts}):
        raise UserInputError(
            f"{source}: routed experts per layer differ ({min(counts)} to {max(counts)}, global-scope pruning); "
            "GGUF and llama.cpp hold one expert count per model: prune with --scope layer"
        )


def check_foldable(config: dict[str, Any], source: Path, fold: bool) -> list[str]:
    """What needs folding (``lowrank``, ``salient``); refused unless ``fold``."""
    qc = quant_config(config) or {}
    needs = [name for name in ("lowrank", "salient") if qc.get(name)]
    if needs and not fold:
        what = " and ".join({"lowrank": "low-rank adapters", "salient": "salient weights"}[n] for n in needs)
        raise UserInputError(
            f"{source}: has {what}, which GGML cannot express; pass --fold to fold them into dense bf16 expert "
            "tensors for the layers that have them (those lose their 4-bit form), or quantize without them"
        )
    return needs


def _gguf_name(layer: int, matrix: str) -> str:
    return f"blk.{layer}.ffn_{matrix}_exps.weight"


class _BlockCollector:
    """Turns each layer's quantised experts into GGML blocks, measured against ours, and writes them out."""

    def __init__(self, writer: CheckpointWriter):
        self.writer = writer
        self.types: dict[str, str] = {}
        self.errors: dict[str, dict[str, Any]] = {}
        self.folded: dict[str, list[str]] = {}

    def __call__(self, layer: SourceLayer, folded: dict[str, torch.Tensor]) -> None:
        if layer.moe is None or layer.gate_up_q is None:
            return
        inter = layer.moe.intermediate_size
        parts = []
        if "gate_up" not in folded:
            rows = torch.arange(2 * inter)
            parts += [
                ("gate", layer.gate_up_q.take_rows(rows[:inter])),
                ("up", layer.gate_up_q.take_rows(rows[inter:])),
            ]
        if "down" not in folded:
            parts.append(("down", layer.down_q))
        if folded:
            self.folded[str(layer.layer)] = sorted(folded)
        tensors = {}
        for matrix, q in parts:
            name = _gguf_name(layer.layer, matrix)
            blocks = ggml_blocks.to_ggml(q)
            self.types[name] = blocks.type_name
            self.errors[name] = {"type": blocks.type_name, **ggml_blocks.measure(q, blocks).to_dict()}
            tensors[name] = torch.from_numpy(blocks.blocks)
        if tensors:
            self.writer.add(tensors, unit=f"layer-{layer.layer}")


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


def _file_type(types: dict[str, str]) -> str | None:
    kinds = set(types.values())
    return FILE_TYPES[kinds.pop()] if len(kinds) == 1 else None


def verify_blocks(out: Path, blocks_file: Path, names: list[str]) -> None:
    """The written file holds exactly our blocks under each substituted name."""
    import gguf
    from safetensors import safe_open

    reader = gguf.GGUFReader(out)
    found = {tensor.name: tensor for tensor in reader.tensors}
    with safe_open(blocks_file, framework="np") as ours:
        for name in names:
            raw = found[name].data
            if raw.reshape(-1).view("uint8").tobytes() != ours.get_tensor(name).tobytes():
                raise RuntimeError(f"{out}: tensor {name} does not hold the blocks written for it")


def _export_native(
    source: Path,
    converter: Path,
    partial: Path,
    work: Path,
    config: dict[str, Any],
    outtype: str,
    needs: list[str],
    progress: bool,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A native-format checkpoint: the dequantised view through the converter with our expert blocks substituted.
    Returns the converter driver's result and the report's entries."""
    report: dict[str, Any] = {}
    collector = _BlockCollector(CheckpointWriter(work / "blocks", max_shard_bytes=1 << 62))
    view = work / "view"
    dense = export_bf16(source, view, progress=progress, layer_hook=collector)
    collector.writer.finish({})
    blocks_file = work / "blocks" / "model.safetensors"
    done = run_converter(
        converter,
        view,
        partial,
        outtype=outtype,
        blocks=blocks_file if collector.types else None,
        types=collector.types,
        file_type=_file_type(collector.types),
    )
    missing = sorted(set(collector.types) - set(done["substituted"]))
    if missing:
        raise RuntimeError(f"the converter did not write {missing[0]}")
    if collector.types:
        verify_blocks(partial, blocks_file, sorted(collector.types))
    report["experts"] = {
        "written_as": sorted(set(collector.types.values())),
        "bounds": {kind: BOUNDS[kind] for kind in sorted(set(collector.types.values()))},
        "tensors": collector.errors,
        "all_exact": all(entry["exact"] for entry in collector.errors.values()),
    }
    if any(scheme.activation_bits for scheme in native_schemes(config)):
        report["experts"]["activations"] = (
            "W4A8: the weights are Q4_0; llama.cpp quantises activations its own way (Q8_0 blocks of 32 on "
            "CPU), not per token as our W4A8 does"
        )
    report["folded"] = {
        "what": needs,
        "layers": collector.folded,
        "how": f"folded matrices are written dense, not as GGML blocks: W_deq + L·R rounded to bf16, stored "
        f"as the converter's --outtype {outtype}",
        "max_abs_rounding_error": dense["folded"]["max_abs_rounding_error"],
    }
    report["other_tensors"] = (
        f"written by the converter (--outtype {outtype}) from the dequantised view: quantised non-expert "
        "weights dequantised to bf16, the rest as stored"
    )
    return done, report


def export_gguf(
    source: Path,
    out: Path,
    *,
    llama_cpp: str | os.PathLike[str] | None = None,
    fold: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Write ``out`` (a .gguf file) and ``out.report.json``; returns the report."""
    out = Path(out).absolute()
    if out.exists() and not overwrite:
        raise UserInputError(f"{out}: exists (pass --overwrite to replace it)")
    if out.is_dir():
        raise UserInputError(f"{out}: is a directory; --format gguf writes one file")
    with CheckpointReader(source) as reader:
        config = reader.config
        outtype = source_outtype(reader)
    adapter = adapter_for(config, source=str(source))
    check_scope(adapter, source)
    native = quant_config(config) is not None
    needs = check_foldable(config, source, fold) if native else []
    if native:
        check_exportable(adapter)
    converter = find_converter(llama_cpp)
    work = out.with_name(f".{out.name}.work")
    shutil.rmtree(work, ignore_errors=True)
    partial = out.with_name(f".{out.name}.partial")
    try:
        work.mkdir(parents=True)
        report: dict[str, Any] = {"format": "gguf", "source": str(source), "converter": str(converter)}
        if native:
            done, details = _export_native(source, converter, partial, work, config, outtype, needs, progress)
            report.update(details)
        else:
            done = run_converter(converter, source, partial, outtype=outtype)
            method = (config.get("quantization_config") or {}).get("quant_method")
            report["experts"] = {
                "written_as": f"as llama.cpp's converter writes them (--outtype {outtype})"
                + (f"; the input's {method} quantisation is the converter's to handle" if method else "")
            }
        report["pre_tokenizer_fallback"] = done["pre_tokenizer_fallback"]
        os.replace(partial, out)
        report["bytes"] = out.stat().st_size
        write_json(report_path(out), report)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)
        partial.unlink(missing_ok=True)
