"""A sharded safetensors writer that finishes atomically.

Tensors are added as layers are produced and flushed into shards of at most ``max_shard_bytes``. All work goes
into a hidden sibling directory marked incomplete; :meth:`CheckpointWriter.finish` names the shards
``model-0000i-of-0000n.safetensors`` (or ``model.safetensors`` for one), writes the index and config, and renames
the directory into place in one step. A killed run therefore never leaves something that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import UserInputError
from .reader import INDEX_NAME, SINGLE_NAME

INCOMPLETE_MARKER = "MOECOMPRESS_INCOMPLETE"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".onnx")


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class CheckpointWriter:
    """Write a checkpoint into ``out_dir`` shard by shard; nothing appears at ``out_dir`` until :meth:`finish`."""

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        overwrite: bool = False,
    ):
        self.out_dir = Path(out_dir).absolute()
        if self.out_dir.exists() and not overwrite:
            raise UserInputError(f"{self.out_dir}: output directory exists (pass --overwrite to replace it)")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.work_dir = self.out_dir.parent / f".{self.out_dir.name}.incomplete"
        if self.work_dir.exists():
            shutil.rmtree(self.work_dir)
        self.work_dir.mkdir()
        (self.work_dir / INCOMPLETE_MARKER).write_text("moecompress is still writing this directory\n")
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self._written: set[str] = set()
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Queue tensors for writing; a shard is flushed whenever the queue would pass the size limit."""
        for key, tensor in tensors.items():
            if key in self._written or key in self._pending:
                raise ValueError(f"tensor {key!r} written twice")
            size = _tensor_bytes(tensor)
            if self._pending and self._pending_bytes + size > self.max_shard_bytes:
                self._flush()
            self._pending[key] = tensor.detach().contiguous().cpu()
            self._pending_bytes += size

    def _flush(self) -> None:
        if not self._pending:
            return
        name = f"shard-{len(self._shards):05d}.safetensors.tmp"
        save_file(self._pending, str(self.work_dir / name), metadata={"format": "pt"})
        self._shards.append((name, list(self._pending)))
        self._written.update(self._pending)
        self.total_bytes += self._pending_bytes
        self._pending = {}
        self._pending_bytes = 0

    def write_json(self, name: str, content: dict[str, Any]) -> None:
        (self.work_dir / name).write_text(json.dumps(content, indent=2, sort_keys=False) + "\n")

    def copy_side_files(self, source_dir: str | os.PathLike[str]) -> list[str]:
        """Copy the tokenizer, generation config, processor and template files (everything but weights,
        the shard index and config.json) from the input directory. Links are followed."""
        copied = []
        for path in sorted(Path(source_dir).iterdir()):
            if not path.is_file() or path.name in ("config.json", INDEX_NAME, INCOMPLETE_MARKER):
                continue
            if path.name.endswith(_WEIGHT_SUFFIXES) or path.name == "moecompress_report.json":
                continue
            shutil.copyfile(path, self.work_dir / path.name)
            copied.append(path.name)
        return copied

    def finish(self, config: dict[str, Any]) -> Path:
        """Name the shards, write the index and ``config.json``, then move the directory into place."""
        self._flush()
        total = len(self._shards)
        weight_map: dict[str, str] = {}
        for number, (tmp_name, keys) in enumerate(self._shards, start=1):
            final = SINGLE_NAME if total == 1 else f"model-{number:05d}-of-{total:05d}.safetensors"
            os.replace(self.work_dir / tmp_name, self.work_dir / final)
            weight_map.update({key: final for key in keys})
        if total > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            self.write_json(INDEX_NAME, index)
        self.write_json("config.json", config)
        (self.work_dir / INCOMPLETE_MARKER).unlink()
        if self.out_dir.exists():
            backup = self.out_dir.parent / f".{self.out_dir.name}.replaced"
            os.replace(self.out_dir, backup)
            os.replace(self.work_dir, self.out_dir)
            shutil.rmtree(backup)
        else:
            os.replace(self.work_dir, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        """Remove the work directory (used when a run fails before finishing)."""
        shutil.rmtree(self.work_dir, ignore_errors=True)
