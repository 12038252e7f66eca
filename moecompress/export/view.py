"""The directory llama.cpp's converter reads for a native-format checkpoint: a plain Hugging Face checkpoint in the
per-expert on-disk layout, except that the routed experts we replace by our own GGML blocks are holes.

Their safetensors entries are there (name, dtype, shape, offsets) but their bytes are never written: each is a
sparse range of the shard, and the converter, which loads tensors lazily, never reads them because ours take their
place. The shards are cut exactly where :class:`~moecompress.checkpoint.CheckpointWriter` cuts a fully written view,
because the converter's tensor order (and so the GGUF file) follows the shards: each shard's tensors sorted by name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from .. import files
from ..checkpoint.reader import INDEX_NAME, SAFETENSORS_DTYPES, SINGLE_NAME
from ..checkpoint.writer import DEFAULT_MAX_SHARD_BYTES, _copy_behind, _insert_in_front, shard_header
from ..files import write_json

_NOT_SIDE_FILES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".onnx")


class ConverterView:
    """Written tensor by tensor; a tensor on the meta device is a hole of its size."""

    def __init__(self, directory: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.shards: list[list[tuple[str, str, list[int], int]]] = []
        self.sizes: list[int] = []
        self._data: Any = None
        directory.mkdir(parents=True)

    def _data_path(self, shard: int) -> Path:
        return self.directory / f"shard-{shard + 1:05d}.data"

    def _next_shard(self) -> None:
        self._close()
        self.shards.append([])
        self.sizes.append(0)
        self._data = open(self._data_path(len(self.shards) - 1), "wb", buffering=0)

    def _close(self) -> None:
        if self._data is not None:
            self._data.truncate(self.sizes[-1])
            self._data.close()
            self._data = None

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, tensor in tensors.items():
            nbytes = tensor.numel() * tensor.element_size()
            if not self.shards or (self.shards[-1] and self.sizes[-1] + nbytes > self.max_shard_bytes):
                self._next_shard()
            self.shards[-1].append((key, SAFETENSORS_DTYPES[tensor.dtype], list(tensor.shape), nbytes))
            self.sizes[-1] += nbytes
            if tensor.is_meta:
                self._data.seek(nbytes, os.SEEK_CUR)
            else:
                files.write_chunk(self._data, files.tensor_bytes(tensor))

    def finish(self, config: dict[str, Any], side_files_from: Path) -> None:
        """The shards' headers, the index, ``config.json`` and the tokenizer's files (everything in
        ``side_files_from`` that is not weights, config or index)."""
        if not self.shards:
            self._next_shard()
        self._close()
        total = len(self.shards)
        weight_map: dict[str, str] = {}
        for shard, entries in enumerate(self.shards):
            name = SINGLE_NAME if total == 1 else f"model-{shard + 1:05d}-of-{total:05d}.safetensors"
            data, path, prefix = self._data_path(shard), self.directory / name, shard_header(entries)
            if _insert_in_front(data, prefix):
                os.replace(data, path)
            else:
                _copy_behind(path, prefix, data)
                data.unlink()
            weight_map.update({key: name for key, *_ in entries})
        if total > 1:
            index = {"metadata": {"total_size": sum(self.sizes)}, "weight_map": dict(sorted(weight_map.items()))}
            write_json(self.directory / INDEX_NAME, index)
        write_json(self.directory / "config.json", config)
        for path in sorted(side_files_from.iterdir()):
            if path.is_file() and not path.name.endswith(_NOT_SIDE_FILES) and path.name != "config.json":
                if path.name not in (INDEX_NAME, "moecompress_report.json"):
                    shutil.copyfile(path, self.directory / path.name)
