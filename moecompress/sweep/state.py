"""What a calibration sweep leaves on disk so that a killed run can resume it where it stopped.

The sweep hands over every finished layer: the hidden states leaving it (the next layer's inputs, exactly as
computed) and the consumer's result for it (its scores or statistics: tensors plus JSON). They are written (a
*commit*) only once :data:`COMMIT_INTERVAL_S` of work has passed since the last commit, and after the sweep's last
layer: a commit writes the calibration hidden states (tokens x hidden x 4 bytes, 134 MB a layer at
Qwen3-30B-A3B's 16,384 tokens), so committing after every layer wrote more resume state than output, while a kill
loses at most the work since the last commit. A resumed sweep starts at the layer after the last commit with those
hidden states, and the consumer takes the stored results of the layers before it instead of recomputing them.
Everything is safetensors and JSON: nothing is unpickled.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..files import write_safetensors

LayerResult = tuple[dict[str, torch.Tensor], Any]
"""A consumer's result for one layer: named tensors and JSON-ready metadata."""

COMMIT_INTERVAL_S = 600.0
"""Seconds of sweep work after which the next finished layer is committed (the tests set 0: every layer)."""

_HIDDEN = "hidden.safetensors"
_CARRIED = "carried.safetensors"


def load_with_metadata(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    return load_file(str(path)), metadata


class SweepState:
    """The resumable state of one sweep, kept in ``directory`` (inside the output's work directory)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.last_layer: int | None = None
        self._hidden: list[torch.Tensor] | None = None
        self._results: dict[int, LayerResult] = {}
        self._uncommitted: dict[int, LayerResult] = {}
        self._since = time.monotonic()
        self._read()

    def _read(self) -> None:
        path = self.directory / _HIDDEN
        if not path.is_file():
            return
        try:
            tensors, metadata = load_with_metadata(path)
            last = int(metadata["after_layer"])
            layers = json.loads(metadata["result_layers"])
            results = {}
            for layer in layers:
                stored, meta = load_with_metadata(self.directory / f"layer-{layer:05d}.safetensors")
                results[layer] = (stored, json.loads(meta["meta"]))
        except (OSError, KeyError, ValueError, SafetensorError):
            return
        self.last_layer = last
        self._hidden = [tensors[f"batch-{i}"] for i in range(len(tensors))]
        self._results = results

    @property
    def start_layer(self) -> int:
        return 0 if self.last_layer is None else self.last_layer + 1

    def hidden(self) -> list[torch.Tensor]:
        if self._hidden is None:
            raise RuntimeError("no committed hidden states to resume from")
        return self._hidden

    def results(self) -> dict[int, LayerResult]:
        """The stored results of the layers before :attr:`start_layer`, by layer."""
        return dict(self._results)

    def clear(self) -> None:
        """Forget every commit (the sweep starts again at layer 0)."""
        for path in self.directory.glob("*.safetensors"):
            path.unlink()
        self.last_layer, self._hidden, self._results, self._uncommitted = None, None, {}, {}

    def carried(self) -> dict[str, torch.Tensor]:
        """The state the committed layers hand to later ones (:class:`~moecompress.sweep.layer_carry.LayerCarry`)."""
        path = self.directory / _CARRIED
        return load_file(str(path)) if path.is_file() else {}

    def hand_over(self, layer: int, result: LayerResult | None) -> None:
        """Hand over ``layer``'s result without its hidden states: a layer inside a looped segment, whose output
        is not where a resumed sweep could start (it is written with the next commit)."""
        if result is not None:
            self._uncommitted[layer] = result

    def commit(
        self,
        layer: int,
        hidden: list[torch.Tensor],
        result: LayerResult | None,
        carried: dict[str, torch.Tensor] | None = None,
        *,
        last: bool = True,
    ) -> None:
        """Hand over ``layer`` as done; it is written when ``last`` (the sweep's last layer) or when
        :data:`COMMIT_INTERVAL_S` has passed since the last commit: the results of the layers handed over since,
        and the state carried to later layers first, then the hidden states leaving ``layer``."""
        if result is not None:
            self._uncommitted[layer] = result
        if not last and time.monotonic() - self._since < COMMIT_INTERVAL_S:
            return
        for done, (tensors, meta) in sorted(self._uncommitted.items()):
            write_safetensors(self.directory / f"layer-{done:05d}.safetensors", tensors, {"meta": json.dumps(meta)})
        self._results.update(self._uncommitted)
        self._uncommitted = {}
        if carried is not None:
            write_safetensors(self.directory / _CARRIED, carried, {"after_layer": str(layer)})
        metadata = {"after_layer": str(layer), "result_layers": json.dumps(sorted(self._results))}
        write_safetensors(self.directory / _HIDDEN, {f"batch-{i}": h for i, h in enumerate(hidden)}, metadata)
        self.last_layer = layer
        self._since = time.monotonic()
