"""Layer-by-layer rewriting of a checkpoint: read layer i, let a function rewrite its MoE view, write it, free it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import UserInputError
from ..families import FamilyAdapter, MoEWeights, adapter_for
from ..memory import release_freed_memory
from ..progress import bar as progress_bar
from .reader import CheckpointReader
from .writer import DEFAULT_MAX_SHARD_BYTES, CheckpointWriter

LayerFn = Callable[[int, MoEWeights], MoEWeights]


def group_keys_by_layer(reader: CheckpointReader, adapter: FamilyAdapter) -> tuple[dict[int, list[str]], list[str]]:
    """Keys of each decoder layer (in layer order) and the keys outside any layer."""
    layers: dict[int, list[str]] = {}
    outside: list[str] = []
    for key in reader.keys():
        layer = adapter.layer_of_key(key)
        if layer is None:
            outside.append(key)
        else:
            layers.setdefault(layer, []).append(key)
    return dict(sorted(layers.items())), outside


def check_output_is_not_input(source: Path, out_dir: Path) -> None:
    source, out_dir = source.resolve(), Path(out_dir).resolve()
    if out_dir == source or source in out_dir.parents or out_dir in source.parents:
        raise UserInputError(f"{out_dir}: the output may not be the input directory, inside it, or around it")


def layer_unit(layer: int) -> str:
    """The writer unit that holds decoder layer ``layer``'s tensors."""
    return f"layer-{layer}"


OUTSIDE_UNIT = "outside"


def align_resumed_sweep(state: Any, writer: CheckpointWriter) -> None:
    """Line a rewriting sweep's resumable state (a :class:`~moecompress.sweep.state.SweepState`) up with the
    writer: the sweep starts again at layer 0 when the writer lost the unit of a layer the sweep committed, and the
    writer keeps only the units of the layers before where the sweep resumes (and the outside unit)."""
    start = state.start_layer
    if any(layer_unit(layer) not in writer.units for layer in range(start)):
        state.clear()
        start = 0
    writer.keep_units({OUTSIDE_UNIT, *(layer_unit(layer) for layer in range(start))})


def rewrite_checkpoint(
    source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    layer_fn: LayerFn | None = None,
    *,
    config: dict[str, Any] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Stream ``source`` into ``out_dir`` one decoder layer at a time, in the source's on-disk layout: a copy (with
    other shard sizes) or a rewrite of the MoE views for tests and scripts. The passes write through
    :mod:`moecompress.runner.pipeline` (whole-model passes by :func:`~moecompress.runner.pipeline.write_model`).

    ``layer_fn`` receives each MoE layer's view and returns its replacement; ``config`` replaces the source's
    config.json. Peak memory is one layer's tensors. A failure removes the work directory.
    """
    source = Path(source)
    check_output_is_not_input(source, Path(out_dir))
    with CheckpointReader(source) as reader:
        adapter = adapter_for(reader.config, source=str(source))
        layers, outside = group_keys_by_layer(reader, adapter)
        writer = CheckpointWriter(out_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
        try:
            writer.add(reader.read(outside), unit=OUTSIDE_UNIT)
            for layer, keys in progress_bar(layers.items(), desc="writing", unit="layer", disable=not progress):
                moe, rest, layout = adapter.split_layer(layer, reader.pending(keys), consume=True)
                if moe is not None and layer_fn is not None:
                    moe = layer_fn(layer, moe)
                written = adapter.join_layer(layer, moe, rest, layout)
                writer.add(written, unit=layer_unit(layer))
                del moe, rest, written
                release_freed_memory()
            writer.copy_side_files(source)
            return writer.finish(config if config is not None else reader.config)
        except (UserInputError, OSError):
            writer.abort()
            raise
