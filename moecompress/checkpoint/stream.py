"""Layer-by-layer rewriting of a checkpoint: read layer i, let a function rewrite its MoE view, write it, free it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import UserInputError
from ..families import FamilyAdapter, MoEWeights, adapter_for
from ..families.base import Layout
from ..memory import release_freed_memory
from ..progress import bar as progress_bar
from .reader import CheckpointReader
from .writer import DEFAULT_MAX_SHARD_BYTES, CheckpointWriter

LayerFn = Callable[[int, MoEWeights], MoEWeights]
LayerWriter = Callable[
    [int, "MoEWeights | None", dict[str, "torch.Tensor"], "Layout | None"], dict[str, "torch.Tensor"]
]
TensorsFn = Callable[[dict[str, "torch.Tensor"]], dict[str, "torch.Tensor"]]
RawLayerFn = Callable[[int, dict[str, "torch.Tensor"]], dict[str, "torch.Tensor"]]


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
    """Line a rewriting sweep's resumable state (a :class:`~moecompress.sweep_state.SweepState`) up with the
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
    layer_writer: LayerWriter | None = None,
    outside_fn: TensorsFn | None = None,
    config: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = True,
    extra_json: dict[str, dict[str, Any]] | Callable[[], dict[str, dict[str, Any]]] | None = None,
    writer: CheckpointWriter | None = None,
    unit_meta: Callable[[str], Any] | None = None,
    restore_unit: Callable[[str, Any], None] | None = None,
    raw_layer_fn: RawLayerFn | None = None,
    drop_layers: frozenset[int] = frozenset(),
    drop_keys: frozenset[str] = frozenset(),
) -> Path:
    """Stream ``source`` into ``out_dir`` one decoder layer at a time, in the source's on-disk layout.

    ``layer_fn`` receives each MoE layer's view and returns its replacement; ``layer_writer`` (default: the
    adapter's ``join_layer``) turns a layer's view and other tensors into the tensors to write, and
    ``outside_fn`` rewrites the tensors outside the decoder layers (embeddings, head); ``config`` (or a function
    returning it, called once every layer is written) replaces the source's config.json; ``extra_json`` files
    (a report), or a function returning them, are written inside the same atomic finish.
    Peak memory is one layer's tensors.

    ``writer`` is an open (possibly resumed) :class:`CheckpointWriter` for ``out_dir``; layers it already holds
    are not read or rewritten again: ``restore_unit(unit, meta)`` gets the ``unit_meta(unit)`` journalled with
    each of them instead (units: :data:`OUTSIDE_UNIT`, then :func:`layer_unit` of each layer), so the caller can
    rebuild what it accumulates as it goes.

    With ``raw_layer_fn`` the checkpoint is streamed as stored (a quantised release's codes and scales, not
    decoded): each layer's stored tensors go to ``raw_layer_fn(layer, tensors)`` and what it returns is written.
    Layers in ``drop_layers`` (an MTP layer the user drops) are not written, nor are the tensors outside the layers
    named in ``drop_keys`` (a top-level MTP module's).
    A failure that resuming cannot mend (bad input, a full disk) removes the work directory; any other
    interruption leaves it, marked incomplete, for ``resume``.
    """
    source = Path(source)
    check_output_is_not_input(source, Path(out_dir))
    with CheckpointReader(source, decode=raw_layer_fn is None) as reader:
        adapter = adapter_for(reader.config, source=str(source))
        layers, outside = group_keys_by_layer(reader, adapter)
        outside = [key for key in outside if key not in drop_keys]
        if writer is None:
            writer = CheckpointWriter(out_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
        try:

            def add(unit: str, tensors: dict[str, torch.Tensor]) -> None:
                writer.add(tensors, unit=unit, meta=unit_meta(unit) if unit_meta is not None else None)

            if OUTSIDE_UNIT in writer.units:
                if restore_unit is not None:
                    restore_unit(OUTSIDE_UNIT, writer.units[OUTSIDE_UNIT].meta)
            else:
                outside_tensors = reader.read(outside)
                add(OUTSIDE_UNIT, outside_fn(outside_tensors) if outside_fn is not None else outside_tensors)
            join = layer_writer if layer_writer is not None else adapter.join_layer
            for layer, keys in progress_bar(layers.items(), desc="writing", unit="layer", disable=not progress):
                unit = layer_unit(layer)
                if layer in drop_layers:
                    continue
                if raw_layer_fn is not None:
                    if unit not in writer.units:
                        add(unit, raw_layer_fn(layer, reader.read_raw(keys)))
                    continue
                if unit in writer.units:
                    if restore_unit is not None:
                        restore_unit(unit, writer.units[unit].meta)
                    continue
                moe, rest, layout = adapter.split_layer(layer, reader.pending(keys), consume=True)
                if moe is not None and layer_fn is not None:
                    moe = layer_fn(layer, moe)
                written = join(layer, moe, rest, layout)
                add(unit, written)
                del moe, rest, written
                release_freed_memory()
            writer.copy_side_files(source)
            files = extra_json() if callable(extra_json) else extra_json
            for name, content in (files or {}).items():
                writer.write_json(name, content)
            final_config = config() if callable(config) else config
            return writer.finish(final_config if final_config is not None else reader.config)
        except (UserInputError, OSError):
            writer.abort()
            raise
