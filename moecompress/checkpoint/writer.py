"""A sharded safetensors writer that streams, finishes atomically and can resume after a kill.

Each :meth:`CheckpointWriter.add` call (one decoder layer, or the tensors outside the layers) is a *unit*: its
tensors' bytes go to disk at once, into a part file of their own, so memory never holds more than the unit being
written. A journal (``journal.jsonl``) records every finished unit: its name, its tensors, the SHA-256 of the part
file and whatever the caller wants restored on resume (per-layer statistics for the report). All work goes into a
hidden sibling directory marked incomplete; :meth:`CheckpointWriter.finish` assembles the parts into shards
(``model-0000i-of-0000n.safetensors``, or ``model.safetensors`` for one; a new shard starts when the next tensor
would pass ``max_shard_bytes``), writes the index and config, and renames the directory into place in one step.
A killed run therefore never leaves something that looks finished, and ``resume=True`` reopens the work
directory, keeps every journalled unit whose part still has its recorded hash, and lets the caller skip them.
The shards depend only on the sequence of units, so a resumed run writes the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UserInputError
from .reader import INDEX_NAME, SAFETENSORS_DTYPES, SINGLE_NAME

INCOMPLETE_MARKER = "MOECOMPRESS_INCOMPLETE"
JOURNAL_NAME = "journal.jsonl"
STATE_DIR = "state"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".onnx")
_COPY_CHUNK = 16 * 2**20


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class _Unit:
    """One journalled ``add``: its part file, its tensors in order ``(key, dtype, shape, nbytes)``, its meta."""

    name: str
    part: str
    tensors: list[tuple[str, str, list[int], int]]
    sha256: str
    meta: Any = None

    def to_json(self) -> str:
        record = {"unit": self.name, "part": self.part, "tensors": self.tensors, "sha256": self.sha256}
        return json.dumps({**record, "meta": self.meta}, separators=(",", ":"))


def _runs(tensors: list[tuple[_Unit, int]]) -> list[tuple[_Unit, int, int]]:
    """Consecutive tensors of the same unit as ``(unit, first index, count)``: one read per stretch of a part."""
    runs: list[tuple[_Unit, int, int]] = []
    for unit, index in tensors:
        if runs and runs[-1][0] is unit and runs[-1][1] + runs[-1][2] == index:
            runs[-1] = (unit, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((unit, index, 1))
    return runs


def _write_part(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[list[tuple[str, str, list[int], int]], str]:
    """Write a unit's bytes and return its entries and SHA-256. Not fsynced: a resumed writer checks every part
    against its hash, so a part lost with the page cache is redone, and a part unlinked at assembly before the
    kernel writes it back never costs disk bandwidth at all."""
    digest = hashlib.sha256()
    entries = []
    with open(path, "wb") as handle:
        for key, tensor in tensors.items():
            if tensor.dtype not in SAFETENSORS_DTYPES:
                raise TypeError(f"{key}: dtype {tensor.dtype} cannot be stored in safetensors")
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            handle.write(data.data)
            digest.update(data.data)
            entries.append((key, SAFETENSORS_DTYPES[tensor.dtype], list(tensor.shape), int(data.size)))
    return entries, digest.hexdigest()


def _copy_range(source, target, start: int, length: int) -> None:
    """Append ``length`` bytes of ``source`` from ``start`` to ``target``: in the kernel where it can
    (``copy_file_range``), through user space otherwise."""
    target.flush()
    copied = 0
    if hasattr(os, "copy_file_range"):
        try:
            while copied < length:
                count = os.copy_file_range(source.fileno(), target.fileno(), length - copied, start + copied)
                if count == 0:
                    break
                copied += count
        except OSError as error:
            if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
        target.seek(0, os.SEEK_END)
    source.seek(start + copied)
    while copied < length:
        chunk = source.read(min(_COPY_CHUNK, length - copied))
        if not chunk:
            raise OSError(f"{source.name}: shorter than its journal says")
        target.write(chunk)
        copied += len(chunk)


class CheckpointWriter:
    """Write a checkpoint into ``out_dir`` unit by unit; nothing appears at ``out_dir`` until :meth:`finish`.

    With ``resume=True`` an existing work directory (left by a killed run) is reopened: :attr:`units` holds the
    journalled units that are intact, in order, and the caller adds only what follows them.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        overwrite: bool = False,
        resume: bool = False,
    ):
        self.out_dir = Path(out_dir).absolute()
        if self.out_dir.exists() and not overwrite:
            raise UserInputError(f"{self.out_dir}: output directory exists (pass --overwrite to replace it)")
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.work_dir = self.out_dir.parent / f".{self.out_dir.name}.incomplete"
        self.max_shard_bytes = max_shard_bytes
        self.units: dict[str, _Unit] = {}
        self.resumed = False
        with self._naming_the_output():
            if resume and (self.work_dir / JOURNAL_NAME).exists():
                self._reopen()
            else:
                self._start()
        self._keys = {key for unit in self.units.values() for key, *_ in unit.tensors}

    @property
    def total_bytes(self) -> int:
        return sum(nbytes for unit in self.units.values() for *_, nbytes in unit.tensors)

    @property
    def state_dir(self) -> Path:
        """Where passes keep what a resumed run needs besides the written units (calibration sweep states)."""
        path = self.work_dir / STATE_DIR
        path.mkdir(exist_ok=True)
        return path

    def _start(self) -> None:
        if self.work_dir.exists():
            shutil.rmtree(self.work_dir)
        self.work_dir.mkdir()
        try:
            (self.work_dir / INCOMPLETE_MARKER).write_text("moecompress is still writing this directory\n")
            header = {"writer": 1, "max_shard_bytes": self.max_shard_bytes}
            (self.work_dir / JOURNAL_NAME).write_text(json.dumps(header) + "\n")
        except OSError:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            raise

    def _reopen(self) -> None:
        """Keep the longest prefix of journalled units whose parts are intact; drop everything after it."""
        lines = (self.work_dir / JOURNAL_NAME).read_text().split("\n")
        try:
            header = json.loads(lines[0])
        except json.JSONDecodeError:
            header = {}
        if header.get("max_shard_bytes") != self.max_shard_bytes:
            self._start()
            return
        for line in lines[1:]:
            try:
                record = json.loads(line)
                unit = _Unit(record["unit"], record["part"], [tuple(t) for t in record["tensors"]], record["sha256"])
                unit.meta = record.get("meta")
            except (json.JSONDecodeError, KeyError, TypeError):
                break
            part = self.work_dir / unit.part
            if not part.is_file() or file_sha256(part) != unit.sha256:
                break
            self.units[unit.name] = unit
        self.resumed = True
        self._rewrite_journal()

    def _rewrite_journal(self) -> None:
        """The journal holding exactly :attr:`units`; part files no unit names are removed."""
        header = json.dumps({"writer": 1, "max_shard_bytes": self.max_shard_bytes})
        temporary = self.work_dir / (JOURNAL_NAME + ".tmp")
        temporary.write_text("\n".join([header, *(unit.to_json() for unit in self.units.values())]) + "\n")
        os.replace(temporary, self.work_dir / JOURNAL_NAME)
        parts = {unit.part for unit in self.units.values()}
        for path in self.work_dir.glob("part-*"):
            if path.name not in parts:
                path.unlink()

    def keep_units(self, names: set[str] | list[str]) -> None:
        """Forget every unit from the first one not in ``names`` on (a resumed pass that must redo them)."""
        kept: dict[str, _Unit] = {}
        for name, unit in self.units.items():
            if name not in names:
                break
            kept[name] = unit
        if len(kept) != len(self.units):
            self.units = kept
            self._keys = {key for unit in kept.values() for key, *_ in unit.tensors}
            with self._naming_the_output():
                self._rewrite_journal()

    @contextlib.contextmanager
    def _naming_the_output(self):
        """An OS error while writing (a full disk above all) names the output directory, not a temporary file."""
        try:
            yield
        except OSError as error:
            raise OSError(error.errno, error.strerror, str(self.out_dir)) from error

    def add(self, tensors: dict[str, torch.Tensor], *, unit: str | None = None, meta: Any = None) -> None:
        """Write ``tensors`` now as the unit ``unit`` (default: a running number), journalled with ``meta``."""
        name = unit if unit is not None else f"unit-{len(self.units)}"
        if name in self.units:
            raise ValueError(f"unit {name!r} written twice")
        for key in tensors:
            if key in self._keys:
                raise ValueError(f"tensor {key!r} written twice")
        part = f"part-{len(self.units):05d}.bin"
        with self._naming_the_output():
            entries, digest = _write_part(self.work_dir / part, tensors)
            record = _Unit(name, part, entries, digest, meta)
            with open(self.work_dir / JOURNAL_NAME, "a") as journal:
                journal.write(record.to_json() + "\n")
                journal.flush()
                os.fsync(journal.fileno())
        self.units[name] = record
        self._keys.update(tensors)

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
            if not path.is_file() or path.name in ("config.json", INDEX_NAME, INCOMPLETE_MARKER, JOURNAL_NAME):
                continue
            if path.name.endswith(_WEIGHT_SUFFIXES) or path.name == "moecompress_report.json":
                continue
            shutil.copyfile(path, self.work_dir / path.name)
            copied.append(path.name)
        return copied

    def finish(self, config: dict[str, Any]) -> Path:
        """Assemble the shards, write the index and ``config.json``, then move the directory into place."""
        with self._naming_the_output():
            return self._finish(config)

    def _shard_plan(self) -> list[list[tuple[_Unit, int]]]:
        """Every tensor ``(unit, index within the unit)`` in write order, cut into shards by size."""
        shards: list[list[tuple[_Unit, int]]] = []
        size = 0
        for unit in self.units.values():
            for index, (*_, nbytes) in enumerate(unit.tensors):
                if not shards or (shards[-1] and size + nbytes > self.max_shard_bytes):
                    shards.append([])
                    size = 0
                shards[-1].append((unit, index))
                size += nbytes
        return shards

    def _write_shard(self, path: Path, tensors: list[tuple[_Unit, int]]) -> None:
        entries: dict[str, Any] = {}
        offset = 0
        for unit, index in tensors:
            key, dtype, shape, nbytes = unit.tensors[index]
            entries[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        with open(path, "wb") as out:
            out.write(len(header).to_bytes(8, "little"))
            out.write(header)
            for unit, first, count in _runs(tensors):
                start = sum(t[3] for t in unit.tensors[:first])
                length = sum(t[3] for t in unit.tensors[first : first + count])
                with open(self.work_dir / unit.part, "rb") as part:
                    _copy_range(part, out, start, length)

    def _finish(self, config: dict[str, Any]) -> Path:
        shards = self._shard_plan()
        total = len(shards)
        weight_map: dict[str, str] = {}
        for number, tensors in enumerate(shards, start=1):
            final = SINGLE_NAME if total == 1 else f"model-{number:05d}-of-{total:05d}.safetensors"
            self._write_shard(self.work_dir / final, tensors)
            weight_map.update({unit.tensors[index][0]: final for unit, index in tensors})
            last_units = {unit.part for unit, _ in tensors}
            later_units = {unit.part for shard in shards[number:] for unit, _ in shard}
            for part in last_units - later_units:
                (self.work_dir / part).unlink()
        if total > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            self.write_json(INDEX_NAME, index)
        self.write_json("config.json", config)
        shutil.rmtree(self.work_dir / STATE_DIR, ignore_errors=True)
        (self.work_dir / JOURNAL_NAME).unlink()
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
        """Remove the work directory (used when a run fails in a way a resume would not mend)."""
        shutil.rmtree(self.work_dir, ignore_errors=True)
