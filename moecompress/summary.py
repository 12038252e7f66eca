"""What ``moecompress inspect`` reports: structure from the config, sizes and dtypes from shard headers alone."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .checkpoint import CheckpointReader
from .families import PARAM_CLASSES, adapter_for


def summarize(directory: Path) -> dict[str, Any]:
    """A JSON-ready summary of the model in ``directory``; no weights are read."""
    with CheckpointReader(directory) as reader:
        adapter = adapter_for(reader.config, source=str(directory))
        shape = adapter.shape()
        parameters: Counter[str] = Counter({name: 0 for name in PARAM_CLASSES})
        dtypes: Counter[str] = Counter()
        for key, info in reader.tensors.items():
            parameters[adapter.classify_key(key)] += info.numel
            dtypes[info.dtype] += info.numel
        summary = asdict(shape)
        summary["experts_per_layer"] = {str(k): v for k, v in shape.experts_per_layer.items()}
        summary.update(
            path=str(directory),
            parameters=dict(parameters),
            parameters_total=sum(parameters.values()),
            bytes_on_disk=reader.total_bytes(),
            shards=len(reader.shard_files),
            dtypes=dict(dtypes.most_common()),
        )
        return summary
