"""What ``moecompress inspect`` reports: structure from the config; sizes, dtypes and the footprint (logical
weights and bits per weight per class, quantisation metadata included) from shard headers alone."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointReader
from ..checkpoint.consistency import check_against_config
from ..families import PARAM_CLASSES, adapter_for
from ..quantization.formats import written_format
from .footprint import checkpoint_footprint


def summarize(directory: Path) -> dict[str, Any]:
    """A JSON-ready summary of the model in ``directory``; no weights are read."""
    with CheckpointReader(directory, decode=False) as reader:
        adapter = adapter_for(reader.config, source=str(directory))
        check_against_config(adapter, reader.tensors, str(directory))
        shape = adapter.shape()
        dtypes: Counter[str] = Counter()
        for info in reader.tensors.values():
            dtypes[info.dtype] += info.numel
        quantization = (reader.config.get("quantization_config") or {}).get("quant_method")
        bytes_on_disk, shards = reader.total_bytes(), len(reader.shard_files)
        heads = {adapter.heads_in_layer(layer) for layer in range(shape.num_layers)}
    footprint = checkpoint_footprint(directory).to_json()
    parameters = {name: footprint["classes"].get(name, {}).get("weights", 0) for name in PARAM_CLASSES}
    summary = asdict(shape)
    summary["experts_per_layer"] = {str(k): v for k, v in shape.experts_per_layer.items()}
    summary.update(
        path=str(directory),
        parameters=parameters,
        parameters_total=sum(parameters.values()),
        bytes_on_disk=bytes_on_disk,
        shards=shards,
        dtypes=dict(dtypes.most_common()),
        quantization=quantization,
        footprint=footprint,
        needs_plugin=_needs_plugin(quantization, set(shape.experts_per_layer.values()), heads),
    )
    return summary


def _needs_plugin(quantization: str | None, expert_counts: set[int], heads: set[tuple[int, int]]) -> str | None:
    """Why stock transformers cannot load the model (it refuses with a size mismatch that names neither cause),
    or None: moecompress's native format, or per-layer expert or head counts."""
    layout = written_format({"quant_method": quantization})
    if layout is not None and layout.needs_plugin:
        return f"moecompress's {layout.name} quantised format"
    if len(expert_counts) > 1:
        return "expert counts that differ by layer"
    if len(heads) > 1:
        return "attention head counts that differ by layer"
    return None
