"""A sharded safetensors writer that streams, finishes atomically and can resume after a kill.

Each :meth:`CheckpointWriter.add` call (one decoder layer, or the tensors outside the layers) is a *unit*: its
tensors' bytes go to disk at once, appended to the data file of the shard they belong to, so memory never holds
more than the unit being written. A new shard starts when the next tensor would pass ``max_shard_bytes``. A
journal (``journal.jsonl``) records every finished unit: its name, its tensors, the SHA-256 of its bytes and
whatever the caller wants restored on resume (per-layer statistics for the report). All work goes into a hidden
sibling directory marked incomplete; :meth:`CheckpointWriter.finish` puts each shard's header in front of its data
(``model-0000i-of-0000n.safetensors``, or ``model.safetensors`` for one), writes the index and config, and renames
the directory into place in one step. A killed run therefore never leaves something that looks finished, and
``resume=True`` reopens the work directory, keeps every journalled unit whose bytes still have their recorded
hash, and lets the caller skip them.

The weight bytes are written once. The header goes in front of the data by ``fallocate(FALLOC_FL_INSERT_RANGE)``,
which shifts the file's extents instead of its bytes (ext4, XFS); elsewhere the shard is copied behind its header.
Every header is padded with spaces (as the format allows) so that the tensor data starts on a 4 KiB boundary, on
either path: the shards depend only on the sequence of units, so a resumed run writes the same bytes as an
uninterrupted one, on any filesystem.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import files
from ..errors import OptionError
from ..files import DiskFullError, appending, is_full, tensor_bytes, write_json, write_text
from ..vocabulary import named
from .reader import INDEX_NAME, SAFETENSORS_DTYPES, SINGLE_NAME

INCOMPLETE_MARKER = "MOECOMPRESS_INCOMPLETE"
PARTIAL_WORK = ("run", "incomplete")
"""The hidden siblings an interrupted run into OUT leaves: ``.OUT.run`` (a recipe run's stages, a whole-model
pass's intermediate checkpoint) and ``.OUT.incomplete`` (a writer's work directory)."""


def hidden_dir(out_dir: Path, kind: str) -> Path:
    """The hidden sibling ``.OUT.KIND`` of ``out_dir``: the one place these names are made (``run`` and
    ``incomplete``, :data:`PARTIAL_WORK`; ``replaced``, an output being replaced; ``lock``, the run lock)."""
    out_dir = Path(out_dir)
    return out_dir.parent / f".{out_dir.name}.{kind}"


JOURNAL_NAME = "journal.jsonl"
STATE_DIR = "state"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
HEADER_ALIGNMENT = 4096
_JOURNAL_VERSION = 2
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".onnx")
_COPY_CHUNK = 16 * 2**20
_FALLOC_FL_INSERT_RANGE = 0x20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _data_name(shard: int) -> str:
    return f"shard-{shard + 1:05d}.data"


@dataclass
class _Unit:
    """One journalled ``add``: its tensors in order ``(key, dtype, shape, nbytes)``, the SHA-256 of their bytes
    and its meta."""

    name: str
    tensors: list[tuple[str, str, list[int], int]]
    sha256: str
    meta: Any = None

    def to_json(self) -> str:
        record = {"unit": self.name, "tensors": self.tensors, "sha256": self.sha256}
        return json.dumps({**record, "meta": self.meta}, separators=(",", ":"))


@dataclass
class _Piece:
    """Consecutive tensors of a unit that land in one shard: ``count`` tensors from ``first``, stored at
    ``offset`` of that shard's data, ``length`` bytes."""

    shard: int
    first: int
    count: int
    offset: int
    length: int


class _ShardPlan:
    """Which shard every tensor goes to, decided as units arrive: a tensor starts a new shard when it would take
    a non-empty shard past ``max_shard_bytes``. Depends only on the sequence of units."""

    def __init__(self, max_shard_bytes: int):
        self.max_shard_bytes = max_shard_bytes
        self.shards: list[list[tuple[_Unit, int]]] = []
        self.sizes: list[int] = []

    def pieces_for(self, unit: _Unit) -> list[_Piece]:
        """Where ``unit``'s tensors would go, without placing them."""
        count, size, pieces = len(self.shards), self.sizes[-1] if self.sizes else 0, []
        nonempty = bool(self.shards and self.shards[-1])
        for index, (*_, nbytes) in enumerate(unit.tensors):
            if count == 0 or (nonempty and size + nbytes > self.max_shard_bytes):
                count, size, nonempty = count + 1, 0, False
            if pieces and pieces[-1].shard == count - 1:
                pieces[-1].count += 1
                pieces[-1].length += nbytes
            else:
                pieces.append(_Piece(count - 1, index, 1, size, nbytes))
            size += nbytes
            nonempty = True
        return pieces

    def place(self, unit: _Unit, pieces: list[_Piece]) -> None:
        for piece in pieces:
            if piece.shard == len(self.shards):
                self.shards.append([])
                self.sizes.append(0)
            self.shards[piece.shard].extend((unit, piece.first + i) for i in range(piece.count))
            self.sizes[piece.shard] += piece.length


def _hash_range(digest: Any, path: Path, start: int, length: int) -> bool:
    """Feed ``length`` bytes of ``path`` from ``start`` to ``digest``; False if the file is missing or shorter."""
    if not path.is_file():
        return False
    with open(path, "rb", buffering=0) as handle:
        handle.seek(start)
        while length > 0:
            chunk = handle.read(min(_COPY_CHUNK, length))
            if not chunk:
                return False
            digest.update(chunk)
            length -= len(chunk)
    return True


@functools.cache
def _fallocate():
    name = ctypes.util.find_library("c")
    try:
        function = ctypes.CDLL(name, use_errno=True).fallocate if name else None
    except (OSError, AttributeError):
        return None
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        function.restype = ctypes.c_int
    return function


def _insert_in_front(path: Path, prefix: bytes) -> bool:
    """Put ``prefix`` (a multiple of :data:`HEADER_ALIGNMENT` long) before the file's bytes without moving them;
    False where the filesystem cannot (the file is then unchanged)."""
    fallocate = _fallocate()
    if fallocate is None or path.stat().st_size == 0:
        return False
    with open(path, "r+b", buffering=0) as handle:
        if fallocate(handle.fileno(), _FALLOC_FL_INSERT_RANGE, 0, len(prefix)) != 0:
            code = ctypes.get_errno()
            if code in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.ENODEV):
                return False
            raise OSError(code, os.strerror(code), str(path))
        files.write_chunk(handle, prefix)
    return True


def _copy_behind(path: Path, prefix: bytes, data: Path) -> None:
    """Write ``prefix`` then all of ``data`` into ``path``: in the kernel where it can (``copy_file_range``)."""
    length = data.stat().st_size
    with open(data, "rb") as source, open(path, "wb", buffering=0) as target:
        files.write_chunk(target, prefix)
        copied = 0
        if hasattr(os, "copy_file_range"):
            try:
                while copied < length:
                    count = os.copy_file_range(source.fileno(), target.fileno(), length - copied, copied)
                    if count == 0:
                        break
                    copied += count
            except OSError as error:
                if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            target.seek(0, os.SEEK_END)
        source.seek(copied)
        while copied < length:
            chunk = source.read(min(_COPY_CHUNK, length - copied))
            if not chunk:
                raise OSError(f"{data}: shorter than its journal says")
            files.write_chunk(target, chunk)
            copied += len(chunk)


def shard_header(entries: list[tuple[str, str, list[int], int]]) -> bytes:
    """The 8-byte length and the JSON header of a shard holding ``entries`` in order, padded with spaces so that
    the data starts at a multiple of :data:`HEADER_ALIGNMENT`."""
    table: dict[str, Any] = {}
    offset = 0
    for key, dtype, shape, nbytes in entries:
        table[key] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = json.dumps({"__metadata__": {"format": "pt"}, **table}, separators=(",", ":")).encode()
    header += b" " * (-(8 + len(header)) % HEADER_ALIGNMENT)
    return len(header).to_bytes(8, "little") + header


def output_exists(out_dir: object) -> OptionError:
    """The refusal of an existing output directory the caller did not ask to replace."""
    return OptionError(f"{out_dir}: output directory exists (pass {named('run.overwrite', True)} to replace it)")


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
            raise output_exists(self.out_dir)
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.work_dir = hidden_dir(self.out_dir, "incomplete")
        self.max_shard_bytes = max_shard_bytes
        self.units: dict[str, _Unit] = {}
        self._plan = _ShardPlan(max_shard_bytes)
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

    def _journal_header(self) -> str:
        return json.dumps({"writer": _JOURNAL_VERSION, "max_shard_bytes": self.max_shard_bytes})

    def _start(self) -> None:
        if self.work_dir.exists():
            shutil.rmtree(self.work_dir)
        self.work_dir.mkdir()
        try:
            write_text(self.work_dir / INCOMPLETE_MARKER, "moecompress is still writing this directory\n")
            write_text(self.work_dir / JOURNAL_NAME, self._journal_header() + "\n")
        except (OSError, DiskFullError):
            shutil.rmtree(self.work_dir, ignore_errors=True)
            raise

    def _reopen(self) -> None:
        """Keep the longest prefix of journalled units whose bytes are intact; drop everything after it."""
        lines = (self.work_dir / JOURNAL_NAME).read_text().split("\n")
        try:
            header = json.loads(lines[0])
        except json.JSONDecodeError:
            header = {}
        if header != json.loads(self._journal_header()):
            self._start()
            return
        for line in lines[1:]:
            try:
                record = json.loads(line)
                unit = _Unit(record["unit"], [tuple(t) for t in record["tensors"]], record["sha256"])
                unit.meta = record.get("meta")
            except (json.JSONDecodeError, KeyError, TypeError):
                break
            pieces = self._plan.pieces_for(unit)
            digest = hashlib.sha256()
            for piece in pieces:
                if not _hash_range(digest, self.work_dir / _data_name(piece.shard), piece.offset, piece.length):
                    break
            if digest.hexdigest() != unit.sha256:
                break
            self._plan.place(unit, pieces)
            self.units[unit.name] = unit
        self.resumed = True
        self._rewrite_journal()

    def _rewrite_journal(self) -> None:
        """The journal holding exactly :attr:`units`; shard data past what they hold is cut off or removed, and
        shards a killed :meth:`finish` left are removed."""
        lines = [self._journal_header(), *(u.to_json() for u in self.units.values())]
        write_text(self.work_dir / JOURNAL_NAME, "\n".join(lines) + "\n")
        sizes = dict(enumerate(self._plan.sizes))
        for path in self.work_dir.glob("shard-*.data"):
            shard = int(path.name[len("shard-") : -len(".data")]) - 1
            if shard in sizes:
                os.truncate(path, sizes[shard])
            else:
                path.unlink()
        for path in self.work_dir.glob("*.safetensors"):
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
            self._plan = _ShardPlan(self.max_shard_bytes)
            for unit in kept.values():
                self._plan.place(unit, self._plan.pieces_for(unit))
            with self._naming_the_output():
                self._rewrite_journal()

    @contextlib.contextmanager
    def _naming_the_output(self):
        """An OS error while writing (a full disk above all) names the output directory, not a temporary file."""
        try:
            yield
        except DiskFullError as error:
            raise error.writing(str(self.out_dir)) from error
        except OSError as error:
            if is_full(error):
                raise DiskFullError(str(self.out_dir), error.errno) from error
            raise OSError(error.errno, error.strerror, str(self.out_dir)) from error

    def add(self, tensors: dict[str, torch.Tensor], *, unit: str | None = None, meta: Any = None) -> None:
        """Write ``tensors`` now as the unit ``unit`` (default: a running number), journalled with ``meta``."""
        name = unit if unit is not None else f"unit-{len(self.units)}"
        if name in self.units:
            raise ValueError(f"unit {name!r} written twice")
        for key in tensors:
            if key in self._keys:
                raise ValueError(f"tensor {key!r} written twice")
        items = [(key, tensor.cpu()) for key, tensor in tensors.items()]  # weights computed on a device
        entries = []
        for key, tensor in items:
            if tensor.dtype not in SAFETENSORS_DTYPES:
                raise TypeError(f"{key}: dtype {tensor.dtype} cannot be stored in safetensors")
            nbytes = tensor.numel() * tensor.element_size()
            entries.append((key, SAFETENSORS_DTYPES[tensor.dtype], list(tensor.shape), nbytes))
        record = _Unit(name, entries, "", meta)
        pieces = self._plan.pieces_for(record)
        digest = hashlib.sha256()
        with self._naming_the_output():
            for piece in pieces:
                with appending(self.work_dir / _data_name(piece.shard), piece.length) as data:
                    if data.tell() != piece.offset:
                        raise RuntimeError(f"{data.name}: holds {data.tell()} bytes, the plan expected {piece.offset}")
                    for _key, tensor in items[piece.first : piece.first + piece.count]:
                        view = tensor_bytes(tensor)
                        files.write_chunk(data, view)
                        digest.update(view)
                        del view
            record.sha256 = digest.hexdigest()
            line = (record.to_json() + "\n").encode()
            with appending(self.work_dir / JOURNAL_NAME, len(line), sync=True) as journal:
                files.write_chunk(journal, line)
        self._plan.place(record, pieces)
        self.units[name] = record
        self._keys.update(tensors)

    def write_json(self, name: str, content: dict[str, Any]) -> None:
        with self._naming_the_output():
            write_json(self.work_dir / name, content)

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

    def _write_shard(self, path: Path, shard: int) -> None:
        """Turn shard ``shard``'s data file into the safetensors file ``path``."""
        data = self.work_dir / _data_name(shard)
        if not data.exists():
            data.touch()
        prefix = shard_header([unit.tensors[index] for unit, index in self._plan.shards[shard]])
        if _insert_in_front(data, prefix):
            os.replace(data, path)
        else:
            _copy_behind(path, prefix, data)
            data.unlink()

    def _finish(self, config: dict[str, Any]) -> Path:
        total = len(self._plan.shards)
        weight_map: dict[str, str] = {}
        for shard, tensors in enumerate(self._plan.shards):
            final = SINGLE_NAME if total == 1 else f"model-{shard + 1:05d}-of-{total:05d}.safetensors"
            self._write_shard(self.work_dir / final, shard)
            weight_map.update({unit.tensors[index][0]: final for unit, index in tensors})
        if total > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            self.write_json(INDEX_NAME, index)
        self.write_json("config.json", config)
        shutil.rmtree(self.work_dir / STATE_DIR, ignore_errors=True)
        (self.work_dir / JOURNAL_NAME).unlink()
        (self.work_dir / INCOMPLETE_MARKER).unlink()
        if self.out_dir.exists():
            backup = hidden_dir(self.out_dir, "replaced")
            os.replace(self.out_dir, backup)
            os.replace(self.work_dir, self.out_dir)
            shutil.rmtree(backup)
        else:
            os.replace(self.work_dir, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        """Remove the work directory (used when a run fails in a way a resume would not mend)."""
        shutil.rmtree(self.work_dir, ignore_errors=True)
