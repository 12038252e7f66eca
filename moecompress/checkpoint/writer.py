"""A sharded safetensors writer that streams and finishes atomically.

Each tensor's bytes go to disk the moment it is added (into the current shard's data file), so memory never holds
more than the tensor being written, whatever the shard size. When a shard reaches ``max_shard_bytes`` its
safetensors header is written and the data appended behind it. All work goes into a hidden sibling directory
marked incomplete; :meth:`CheckpointWriter.finish` names the shards ``model-0000i-of-0000n.safetensors`` (or
``model.safetensors`` for one), writes the index and config, and renames the directory into place in one step.
A killed run therefore never leaves something that looks finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..errors import UserInputError
from .reader import INDEX_NAME, SAFETENSORS_DTYPES, SINGLE_NAME

INCOMPLETE_MARKER = "MOECOMPRESS_INCOMPLETE"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".onnx")


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _ShardFile:
    """One shard being written: tensor bytes appended to a data file, the header written at close."""

    def __init__(self, data_path: Path):
        self.data_path = data_path
        self.handle = open(data_path, "wb")
        self.entries: dict[str, dict[str, Any]] = {}
        self.size = 0

    def append(self, key: str, tensor: torch.Tensor) -> None:
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{key}: dtype {tensor.dtype} cannot be stored in safetensors")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.handle.write(data.tobytes())
        nbytes = data.size
        self.entries[key] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self.size, self.size + nbytes],
        }
        self.size += nbytes

    def close(self, final_path: Path) -> None:
        """Write ``final_path`` as header + data and remove the data file."""
        self.handle.close()
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        with open(final_path, "wb") as out, open(self.data_path, "rb") as data:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            shutil.copyfileobj(data, out, 16 * 2**20)
        self.data_path.unlink()


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
        try:
            (self.work_dir / INCOMPLETE_MARKER).write_text("moecompress is still writing this directory\n")
        except OSError as error:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            raise OSError(error.errno, error.strerror, str(self.out_dir)) from error
        self.max_shard_bytes = max_shard_bytes
        self._current: _ShardFile | None = None
        self._shards: list[tuple[str, list[str]]] = []
        self._keys: set[str] = set()
        self.total_bytes = 0

    @contextlib.contextmanager
    def _naming_the_output(self):
        """An OS error while writing (a full disk above all) names the output directory, not a temporary file."""
        try:
            yield
        except OSError as error:
            raise OSError(error.errno, error.strerror, str(self.out_dir)) from error

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write tensors now; a new shard starts whenever the current one would pass the size limit."""
        with self._naming_the_output():
            self._add(tensors)

    def _add(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, tensor in tensors.items():
            if key in self._keys:
                raise ValueError(f"tensor {key!r} written twice")
            size = _tensor_bytes(tensor)
            if self._current is not None and self._current.entries and self._current.size + size > self.max_shard_bytes:
                self._close_shard()
            if self._current is None:
                self._current = _ShardFile(self.work_dir / f"shard-{len(self._shards):05d}.data.tmp")
            self._current.append(key, tensor)
            self._keys.add(key)
            self.total_bytes += size

    def _close_shard(self) -> None:
        if self._current is None:
            return
        name = f"shard-{len(self._shards):05d}.safetensors.tmp"
        self._current.close(self.work_dir / name)
        self._shards.append((name, list(self._current.entries)))
        self._current = None

    def write_json(self, name: str, content: dict[str, Any]) -> None:
        with self._naming_the_output():
            (self.work_dir / name).write_text(json.dumps(content, indent=2, sort_keys=False) + "\n")

    def copy_side_files(self, source_dir: str | os.PathLike[str]) -> list[str]:
        """Copy the tokenizer, generation config, processor and template files (everything but weights,
        the shard index and config.json) from the input directory. Links are followed."""
        with self._naming_the_output():
            return self._copy_side_files(source_dir)

    def _copy_side_files(self, source_dir: str | os.PathLike[str]) -> list[str]:
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
        with self._naming_the_output():
            return self._finish(config)

    def _finish(self, config: dict[str, Any]) -> Path:
        self._close_shard()
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
        if self._current is not None:
            self._current.handle.close()
        shutil.rmtree(self.work_dir, ignore_errors=True)
