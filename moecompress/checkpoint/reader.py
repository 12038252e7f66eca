"""A lazy reader over a safetensors checkpoint: one file or shards with ``model.safetensors.index.json``.

Opening reads only headers; tensors are materialised on request, one decoder layer at a time, so a
checkpoint far larger than memory can be streamed.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import trust
from ..errors import OptionError, UserInputError
from ..kernels.finite import all_finite
from ..vocabulary import named
from .consistency import DTYPE_BYTES, MAX_HEADER_BYTES, check_config_types, check_header
from .decode import plan_decoding, target_dtype
from .decoders import Encoded, InputFormat

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_INDEX_NAME = "pytorch_model.bin.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
ADVICE_CHUNK = 512 * 1024
"""Bytes per read-ahead advice: Linux reads at most the device's read-ahead or request size per call (128 KiB to
a few MiB), so a layer is advised in pieces of about that size."""
_ADVISING: ThreadPoolExecutor | None = None


SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}

_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's header entry: where it lives, its dtype name and shape."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    """Where the tensor's bytes start in the file (safetensors only)."""

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 1)


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, validated against the file's size."""
    return _header_and_data_start(path)[0]


def _header_and_data_start(path: Path) -> tuple[dict[str, Any], int]:
    """The validated header (:func:`.consistency.check_header`) and the file offset where the data section
    starts."""
    if path.is_dir():
        raise UserInputError(f"{path}: a directory, not a safetensors file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            raw_len = handle.read(8)
            if len(raw_len) < 8:
                raise UserInputError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > size - 8:
                raise UserInputError(f"{path}: truncated or corrupt safetensors file (header runs past the end)")
            if header_len > MAX_HEADER_BYTES:
                raise UserInputError(f"{path}: corrupt safetensors file (a {header_len}-byte header)")
            header = json.loads(handle.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserInputError(f"{path}: corrupt safetensors header ({error})") from None
    data_len = size - 8 - header_len
    end = max(_ends(header), default=0)
    if end > data_len:
        raise UserInputError(f"{path}: truncated safetensors file ({data_len} data bytes, header needs {end})")
    check_header(path, header, data_len)
    return header, 8 + header_len


def _ends(header: Any) -> list[int]:
    """Where each entry's data ends, for entries well-formed enough to say (the rest fail :func:`check_header`)."""
    if not isinstance(header, dict):
        return []
    ends = []
    for key, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) and key != "__metadata__" else None
        if isinstance(offsets, list) and len(offsets) == 2 and isinstance(offsets[1], int):
            ends.append(offsets[1])
    return ends


class CheckpointReader:
    """Headers of every shard, a key→shard map, and tensors read on demand.

    A quantised release (``quantization_config`` of FP8, gpt-oss MXFP4 or compressed-tensors) is decoded on read
    unless ``decode`` is False: :attr:`tensors` then names each weight as its bf16 release does, reading it
    decodes its codes and scales (:mod:`.decode`), and :attr:`raw_tensors` and :meth:`read_raw` give the stored
    tensors themselves. :attr:`input_format` says what was found."""

    def __init__(self, directory: str | os.PathLike[str], decode: bool = True):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise UserInputError(f"{self.directory}: no such model directory")
        config_path = self.directory / "config.json"
        if not config_path.is_file():
            raise UserInputError(f"{self.directory}: no config.json; not a Hugging Face model directory")
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as error:
            raise UserInputError(f"{config_path}: invalid JSON ({error})") from None
        except UnicodeDecodeError as error:
            raise UserInputError(f"{config_path}: not UTF-8 text (byte {error.start})") from None
        self.config: dict[str, Any] = check_config_types(config, config_path)
        self._pickled: dict[str, dict[str, torch.Tensor]] = {}
        """Memory-mapped state dicts of pickle shards (only with --allow-pickle)."""
        self.shard_files = self._shard_files()
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self.shard_files:
            if shard in self._pickled:
                for key, tensor in self._pickled[shard].items():
                    self.tensors[key] = TensorInfo(shard, SAFETENSORS_DTYPES[tensor.dtype], tuple(tensor.shape))
                continue
            header, data_start = _header_and_data_start(self.directory / shard)
            for key, entry in header.items():
                if key != "__metadata__":
                    start = data_start + entry["data_offsets"][0]
                    self.tensors[key] = TensorInfo(shard, entry["dtype"], tuple(entry["shape"]), start)
        self.raw_tensors: dict[str, TensorInfo] = self.tensors
        self.input_format: InputFormat | None = None
        self._encoded: dict[str, Encoded] = {}
        if decode:
            self._plan_decoding()

    def _plan_decoding(self) -> None:
        shapes = {key: (info.shape, info.dtype) for key, info in self.raw_tensors.items()}
        found = plan_decoding(self.config, shapes, lambda key: self._read_raw(key, False))
        if found is None:
            return
        self.input_format = found
        self._encoded = found.encoded
        hidden = found.raw_keys
        dtype_name = SAFETENSORS_DTYPES[target_dtype(self.config)]
        tensors = {key: info for key, info in self.raw_tensors.items() if key not in hidden}
        for key, encoded in found.encoded.items():
            tensors[key] = TensorInfo(self.raw_tensors[encoded.parts["codes"]].file, dtype_name, encoded.shape)
        self.tensors = tensors

    def _shard_files(self) -> list[str]:
        index_path = self.directory / INDEX_NAME
        if index_path.is_file():
            return self._indexed_shards(index_path)
        if (self.directory / SINGLE_NAME).is_dir():
            raise UserInputError(f"{self.directory / SINGLE_NAME}: a directory, not a safetensors file")
        if (self.directory / SINGLE_NAME).is_file():
            return [SINGLE_NAME]
        found = sorted(p.name for p in self.directory.glob("*.safetensors") if p.is_file())
        if found:
            return found
        pickled = self._pickle_shards()
        if pickled:
            return pickled
        raise UserInputError(f"{self.directory}: no safetensors weights (model.safetensors or {INDEX_NAME})")

    def _indexed_shards(self, index_path: Path) -> list[str]:
        """The shards ``model.safetensors.index.json`` names: file names inside the directory, each present and a
        file."""
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as error:
            raise UserInputError(f"{index_path}: invalid shard index ({type(error).__name__}: {error})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise UserInputError(f"{index_path}: invalid shard index (weight_map is not an object of file names)")
        files = sorted(set(weight_map.values()))
        for name in files:
            path = self.directory / name
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise UserInputError(f"{index_path}: names shard {name!r}, outside the model directory")
            if path.is_dir():
                raise UserInputError(f"{index_path}: names shard {name!r}, which is a directory, not a file")
            if not path.is_file():
                raise UserInputError(f"{index_path}: names shard {name!r}, which is missing")
        return files

    def _pickle_shards(self) -> list[str]:
        """Pickle weight files, refused unless pickle is allowed, then opened with ``weights_only=True``."""
        index_path = self.directory / PICKLE_INDEX_NAME
        if index_path.is_file():
            try:
                files = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError, AttributeError) as error:
                raise UserInputError(f"{index_path}: invalid shard index ({error})") from None
        else:
            files = sorted(p.name for p in self.directory.iterdir() if p.is_file() and p.suffix in PICKLE_SUFFIXES)
        if not files:
            return []
        if not trust.CURRENT.pickle:
            raise OptionError(
                f"{self.directory}: the weights are pickle files ({files[0]}), which can run code when loaded; "
                f"pass {named('run.allow_pickle', True)} to read them with torch.load(weights_only=True)"
            )
        for name in files:
            path = self.directory / name
            if not path.is_file():
                raise UserInputError(f"{index_path}: names shard {name!r}, which is missing")
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as error:  # torch raises UnpicklingError, RuntimeError, EOFError, ... for bad files
                reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise UserInputError(f"{path}: refused by torch.load(weights_only=True): {reason}") from None
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise UserInputError(f"{path}: not a state dict of tensors")
            self._pickled[name] = state
        return files

    # ---- metadata -------------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self.tensors)

    def total_bytes(self) -> int:
        """Bytes on disk of all weight shards."""
        return sum((self.directory / shard).stat().st_size for shard in self.shard_files)

    # ---- data -----------------------------------------------------------------------------------------
    def tensor(self, key: str) -> torch.Tensor:
        return self.read([key])[key]

    def read(self, keys: Iterable[str], check_finite: bool = True) -> dict[str, torch.Tensor]:
        """Materialise ``keys``. Plain reads rather than a memory map: a mapped shard's pages would count in the
        process's resident set on top of the copy, doubling the peak of a layer. A floating-point tensor
        holding NaN or Inf is refused, naming the tensor and its shard."""
        return {key: pending.load() for key, pending in self.pending(keys, check_finite).items()}

    def pending(self, keys: Iterable[str], check_finite: bool = True) -> dict[str, PendingTensor]:
        """``keys`` as :class:`PendingTensor` s, read only when loaded (so a consumer can read each one straight
        into its place in a larger buffer)."""
        out = {}
        for key in keys:
            if key not in self.tensors:
                raise KeyError(f"{self.directory}: no tensor {key!r}")
            out[key] = PendingTensor(self, key, check_finite)
        return out

    def dtype_of(self, key: str) -> torch.dtype:
        return self._dtype_of(self.tensors[key], key)

    def _dtype_of(self, info: TensorInfo, key: str) -> torch.dtype:
        try:
            return _TORCH_DTYPES[info.dtype]
        except KeyError:
            raise UserInputError(
                f"{self.directory / info.file}: tensor {key!r} has unsupported dtype {info.dtype}"
            ) from None

    def read_raw(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Stored tensors by their stored names (codes and scales of a quantised release, not decoded)."""
        return {key: self._read_raw(key, True) for key in keys}

    def _read_raw(self, key: str, check_finite: bool) -> torch.Tensor:
        info = self.raw_tensors[key]
        out = torch.empty(info.shape, dtype=self._dtype_of(info, key), device="cpu")
        self._read_stored(key, info, out, check_finite)
        return out

    def read_into(self, key: str, out: torch.Tensor, check_finite: bool = True) -> None:
        """Read tensor ``key`` into ``out`` (contiguous, of its shape and dtype)."""
        encoded = self._encoded.get(key)
        if encoded is not None:
            parts = {name: self._read_raw(raw, False) for name, raw in encoded.parts.items()}
            value = encoded.decode(parts)
            if tuple(value.shape) != tuple(out.shape):
                raise UserInputError(
                    f"{self.directory}: {key} decodes to shape {list(value.shape)}, expected {list(out.shape)}"
                )
            out.copy_(value)
            if check_finite and not all_finite(out):
                raise UserInputError(f"{self.directory}: tensor {key!r} decodes to NaN or Inf values")
            return
        self._read_stored(key, self.tensors[key], out, check_finite)

    def _read_stored(self, key: str, info: TensorInfo, out: torch.Tensor, check_finite: bool) -> None:
        if info.file in self._pickled:
            out.copy_(self._pickled[info.file][key])
        else:
            if not out.is_contiguous() or tuple(out.shape) != info.shape or out.dtype != self._dtype_of(info, key):
                raise ValueError(f"{key}: cannot read a {info.dtype} {list(info.shape)} tensor into this buffer")
            buffer = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
            with open(self.directory / info.file, "rb", buffering=0) as handle:
                done = 0
                while done < len(buffer):
                    count = os.preadv(handle.fileno(), [buffer[done:]], info.offset + done)
                    if count == 0:
                        raise UserInputError(f"{self.directory / info.file}: truncated while reading tensor {key!r}")
                    done += count
        if check_finite and out.is_floating_point() and out.element_size() > 1 and not all_finite(out):
            raise UserInputError(f"{self.directory / info.file}: tensor {key!r} holds NaN or Inf values")

    def advise(self, keys: Iterable[str]) -> None:
        """Tell the kernel that ``keys`` will be read soon (``POSIX_FADV_WILLNEED``, issued from a background
        thread, as a full disk queue can make it wait): it reads their stored bytes into the page cache, so that a
        later read overlaps the compute before it instead of waiting on the disk. It costs no memory of this
        process and next to no CPU; nothing where the platform lacks ``posix_fadvise``."""
        if not hasattr(os, "posix_fadvise"):
            return
        global _ADVISING
        if _ADVISING is None:
            _ADVISING = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moecompress-readahead")
        _ADVISING.submit(self._advise, list(keys))

    def _advise(self, keys: list[str]) -> None:
        spans: dict[str, list[tuple[int, int]]] = {}
        for key in keys:
            encoded = self._encoded.get(key)
            for name in encoded.parts.values() if encoded is not None else [key]:
                info = self.raw_tensors.get(name)
                if info is not None and info.file not in self._pickled:
                    spans.setdefault(info.file, []).append((info.offset, info.offset + info.nbytes))
        for file, ranges in spans.items():
            try:
                fd = os.open(self.directory / file, os.O_RDONLY)
            except OSError:
                continue
            try:
                for start, end in _merged(ranges):
                    for chunk in range(start, end, ADVICE_CHUNK):
                        os.posix_fadvise(fd, chunk, min(ADVICE_CHUNK, end - chunk), os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
            finally:
                os.close(fd)

    def close(self) -> None:
        """Nothing stays open between reads; kept so the reader works as a context manager."""

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, end)`` byte ranges sorted, with touching or overlapping ones joined."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


class PendingTensor:
    """A checkpoint tensor not read yet: its shape and dtype, and the read, into new memory or a given buffer."""

    def __init__(self, reader: CheckpointReader, key: str, check_finite: bool = True):
        self.reader, self.key, self.check_finite = reader, key, check_finite
        self.shape = torch.Size(reader.tensors[key].shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.reader.dtype_of(self.key)

    def load(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype, device="cpu")
        self.reader.read_into(self.key, out, self.check_finite)
        return out

    def load_into(self, out: torch.Tensor) -> None:
        self.reader.read_into(self.key, out, self.check_finite)


def materialise(value: torch.Tensor | PendingTensor) -> torch.Tensor:
    return value.load() if isinstance(value, PendingTensor) else value
