"""What every layer-by-layer write of a checkpoint shares: its keys grouped by decoder layer, the writer unit of
each layer and of the tensors outside the layers, a resumed sweep lined up with its writer, and the refusal to
write over the input. The one loop that writes layer by layer is the pipeline's rewriting sweep
(:mod:`moecompress.runner.pipeline`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UserInputError
from ..families import FamilyAdapter
from .reader import CheckpointReader
from .writer import CheckpointWriter


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
