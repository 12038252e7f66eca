"""Footprint: bytes and effective bits per weight, per parameter class and overall, from shard headers alone.

Every stored byte is counted against the class of the weight it serves: packed codes *and* their scales, zero
points, bitmaps and low-rank adapters (``metadata_bytes`` and ``adapter_bytes`` say how much of ``bytes`` those
are). ``weights`` counts logical (dequantised) weights, so a class's bits per weight is
``8 · bytes / weights``. Salient weights count their coded position bitmap (``bitmap_bytes``, with
``bitmap_raw_bytes`` what a plain one-bit-per-position bitmap would have cost) and their bf16 values
(``salient_value_bytes``), all inside ``metadata_bytes``.

Understood layouts: plain float checkpoints and every registered output format (the native moecompress format,
gpt-oss MXFP4 ``*_blocks``/``*_scales``, compressed-tensors ``weight_packed`` and companions), which counts its own
stored tensors (``OutputFormat.logical_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointReader
from ..checkpoint.reader import TensorInfo
from ..families import adapter_for
from ..quantization.formats import written_format


@dataclass
class ClassFootprint:
    weights: int = 0
    bytes: int = 0
    metadata_bytes: int = 0
    adapter_bytes: int = 0
    bitmap_bytes: int = 0
    bitmap_raw_bytes: int = 0
    salient_value_bytes: int = 0

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.bytes / self.weights if self.weights else 0.0

    @property
    def bits_per_weight_raw_bitmap(self) -> float:
        """Bits per weight had the salient bitmaps been stored plainly (one bit per position)."""
        raw = self.bytes - self.bitmap_bytes + self.bitmap_raw_bytes
        return 8 * raw / self.weights if self.weights else 0.0

    def add(self, other: ClassFootprint) -> None:
        for name in _COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "weights": self.weights,
            "bytes": self.bytes,
            "metadata_bytes": self.metadata_bytes,
            "adapter_bytes": self.adapter_bytes,
            "bits_per_weight": round(self.bits_per_weight, 4),
        }
        if self.bitmap_raw_bytes:
            out.update(
                bitmap_bytes=self.bitmap_bytes,
                bitmap_raw_bytes=self.bitmap_raw_bytes,
                salient_value_bytes=self.salient_value_bytes,
                bits_per_weight_raw_bitmap=round(self.bits_per_weight_raw_bitmap, 4),
            )
        return out


_COUNTS = ("weights", "bytes", "metadata_bytes", "adapter_bytes", "bitmap_bytes", "bitmap_raw_bytes")
_COUNTS += ("salient_value_bytes",)


@dataclass
class Footprint:
    classes: dict[str, ClassFootprint] = field(default_factory=dict)
    file_bytes: int = 0

    @property
    def total(self) -> ClassFootprint:
        total = ClassFootprint()
        for part in self.classes.values():
            total.add(part)
        return total

    def to_json(self) -> dict[str, Any]:
        return {
            "classes": {name: part.to_json() for name, part in self.classes.items() if part.weights or part.bytes},
            "total": self.total.to_json(),
            "file_bytes": self.file_bytes,
        }


def _logical_weights(
    key: str, info: TensorInfo, config: dict[str, Any], scales: TensorInfo | None = None
) -> int | None:
    """Logical weights a tensor stores, 0 for pure metadata, None for a plain float tensor (``scales``: the packed
    weight's ``_scales`` entry, which tells apart layouts of equal packed width): the output format the config
    names counts them."""
    quantization = config.get("quantization_config") or {}
    layout = written_format(quantization)
    return None if layout is None else layout.logical_weights(key, info, quantization, scales)


def _is_adapter(key: str, config: dict[str, Any]) -> bool:
    """Low-rank error adapters: bytes of the class, no logical weights."""
    layout = written_format(config.get("quantization_config") or {})
    return layout is not None and layout.is_adapter(key)


def checkpoint_footprint(directory: Path) -> Footprint:
    """The footprint of the checkpoint in ``directory`` (headers only)."""
    with CheckpointReader(directory, decode=False) as reader:
        adapter = adapter_for(reader.config, source=str(directory))
        footprint = Footprint(file_bytes=reader.total_bytes())
        for key, info in reader.tensors.items():
            part = footprint.classes.setdefault(adapter.classify_key(key), ClassFootprint())
            logical = _logical_weights(key, info, reader.config, reader.tensors.get(f"{key}_scales"))
            part.bytes += info.nbytes
            if logical == 0 and key.endswith("_salient"):
                part.bitmap_bytes += info.nbytes
                positions = _logical_weights(
                    key.removesuffix("_salient"), reader.tensors[key.removesuffix("_salient")], reader.config
                )
                part.bitmap_raw_bytes += -(-(positions or 0) // 8)
            elif logical == 0 and key.endswith("_salient_values"):
                part.salient_value_bytes += info.nbytes
            if _is_adapter(key, reader.config):
                part.adapter_bytes += info.nbytes
            elif logical is None:
                part.weights += info.numel
            elif logical == 0:
                part.metadata_bytes += info.nbytes
            else:
                part.weights += logical
        return footprint
