"""``--format bf16``: a native-format checkpoint dequantised into a plain Hugging Face checkpoint (per-expert
on-disk layout, no ``quantization_config``), streamed one decoder layer at a time: quantised weights become bf16
(which holds every MXFP4 and integer-grid value of ours exactly), unquantised tensors stay as stored. Low-rank
adapters are folded into the expert weights (``W + L·R`` in float32, then rounded to bf16); salient weights are
already part of the dequantised matrix. The report records the folding's largest rounding error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..checkpoint import CheckpointReader, CheckpointWriter
from ..checkpoint.stream import OUTSIDE_UNIT, check_output_is_not_input, layer_unit
from ..errors import OptionError, UserInputError
from ..families import adapter_for
from ..files import DiskFullError
from ..memory import release_freed_memory
from ..progress import bar as progress_bar
from ..runner.preflight import check_replaceable
from ..vocabulary import named
from .source import NativeSource, SourceLayer, check_exportable, fold, quant_config

DTYPE = torch.bfloat16
EXPORT_REPORT = "moecompress_export.json"


def dense_layer(adapter, layer: SourceLayer, folded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's tensors in the per-expert on-disk layout, experts dense (folded where ``folded`` says)."""
    moe = layer.moe
    if moe is None:
        return dict(layer.rest)
    if "gate_up" in folded:
        moe.gate_up = folded["gate_up"].to(DTYPE)
    if "down" in folded:
        moe.down = folded["down"].to(DTYPE)
    return adapter.join_layer(layer.layer, moe, layer.rest, "per_expert")


def fold_error(folded: dict[str, torch.Tensor]) -> float:
    """Largest ``|bf16(W) - W|`` over the folded matrices."""
    return max((float((w.to(DTYPE).float() - w).abs().max()) for w in folded.values()), default=0.0)


def open_native(source: Path) -> tuple[CheckpointReader, NativeSource]:
    reader = CheckpointReader(source)
    if quant_config(reader.config) is None:
        raise OptionError(
            f"{source}: not a moecompress native-format checkpoint (no quantization_config with quant_method "
            f"'moecompress'); {named('format', 'bf16')} dequantises those"
        )
    adapter = adapter_for(reader.config, source=str(source))
    check_exportable(adapter)
    return reader, NativeSource(reader, adapter)


def plain_config(config: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in config.items() if key != "quantization_config"}


def export_bf16(
    source: Path,
    out_dir: Path,
    *,
    overwrite: bool = False,
    progress: bool = True,
    layer_hook=None,
) -> dict[str, Any]:
    """Write the dequantised checkpoint; returns the report (also written as ``moecompress_export.json``).
    ``layer_hook(layer, folded)`` sees each layer before it is written (the GGUF export collects its expert
    blocks there)."""
    check_output_is_not_input(source, out_dir)
    if overwrite and (Path(out_dir).exists() or Path(out_dir).is_symlink()):
        check_replaceable(Path(out_dir))
    reader, native = open_native(source)
    with reader:
        adapter = native.adapter
        writer = CheckpointWriter(out_dir, overwrite=overwrite)
        folded_matrices: dict[str, list[str]] = {}
        worst = 0.0
        try:
            writer.add(native.outside_tensors(), unit=OUTSIDE_UNIT)
            for index in progress_bar(list(native.layers), desc="dequantising", unit="layer", disable=not progress):
                layer = native.layer(index)
                folded = fold(layer) if layer.moe is not None else {}
                if folded:
                    folded_matrices[str(index)] = sorted(folded)
                    worst = max(worst, fold_error(folded))
                if layer_hook is not None:
                    layer_hook(layer, folded)
                writer.add(dense_layer(adapter, layer, folded), unit=layer_unit(index))
                del layer, folded
                release_freed_memory()
            writer.copy_side_files(source)
            report = {
                "format": "bf16",
                "source": str(source),
                "folded": {
                    "layers": folded_matrices,
                    "how": "low-rank adapters added to the dequantised experts (W + L·R, float32) and rounded to "
                    "bf16; salient weights are part of the dequantised matrix",
                    "max_abs_rounding_error": worst,
                },
            }
            writer.write_json(EXPORT_REPORT, report)
            writer.finish(plain_config(reader.config))
        except (UserInputError, OSError, DiskFullError):
            writer.abort()
            raise
    return report
