"""Every tensor in a GGML type: the GGUF the converter wrote, re-written with each float tensor that llama-quantize
would quantise (:mod:`.gguf_types`) encoded by our GGML block encoders, in a type pinned, defaulted, or chosen to a
byte budget (:mod:`.allocation`); tensors already in a block type (our experts' blocks) are copied as they are.

Calibration enters as an importance matrix in llama.cpp's format (``quantize --imatrix-out`` writes ours,
``llama-imatrix`` theirs): each column of a tensor is weighted by its input's mean square over the tokens that reach
it, per expert for ``*_exps``. The error a type gives a tensor is ``sum_e p_e sum_(row, col) E[x_col^2] dW^2``, the
expected squared error of the tensor's output per token under a diagonal input covariance, divided by the same sum
of ``W^2`` (the output's power): a relative error, so that tensors whose outputs live at different scales (the
embedding, queries, a down projection) compare. ``p_e`` is the share of tokens the tensor sees: 1 for dense
tensors, ``count_e / tokens / k^2`` for routed expert ``e`` (routed to ``count_e`` of the layer's ``tokens``, its
output scaled by a gate weight of about ``1/k`` with ``k`` experts per token), and ``1 / rows`` for the token
embedding (one row per token). A decoder layer's tensor then counts ``1 / (2 * block_count)`` of its relative
error: its block adds one of the residual stream's ``2 * block_count`` contributions (attention and FFN per layer),
while the embedding is the whole stream and the head the whole output. Errors are measured on up to
:data:`SAMPLE_ROWS` evenly spaced rows (per expert).
Without an importance matrix every column weighs 1.

The file is read twice (measuring, then writing; memory about one tensor's rows in float32, a chunk at a time) and
written once, tensor by tensor.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import OptionError
from ..files import write_chunk
from ..progress import bar as progress_bar
from ..quantization.schemes.ggml_blocks import FORMATS, ggml_bytes, split
from ..vocabulary import named
from . import gguf_types
from .allocation import Option, allocate, smallest

SAMPLE_ROWS = 64
"""Rows per expert (per 2-D tensor: 4x as many) on which a type's error is measured for the allocation."""
CHUNK_WEIGHTS = 1 << 20
ALIGNMENT = 32
TYPES_KEY = "moecompress.tensor_types"
TARGET_KEY = "moecompress.target_bytes"


@dataclass(frozen=True)
class Request:
    """What the user asked for: pins, the type of unpinned tensors without a budget, a budget, an imatrix."""

    pins: list[gguf_types.Pin] = field(default_factory=list)
    default_type: str = "Q8_0"
    target_bytes: int | None = None
    target_bpw: float | None = None
    imatrix: Path | None = None

    @property
    def budgeted(self) -> bool:
        return self.target_bytes is not None or self.target_bpw is not None


@dataclass
class Importance:
    """Per-column input mean squares ``[experts, cols]`` (1 row for a dense tensor) and each expert's share of
    tokens ``[experts]``."""

    columns: torch.Tensor
    share: torch.Tensor
    measured: bool


def read_imatrix(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``name -> (in_sum2 [experts, cols] or [cols], counts)`` from a llama.cpp GGUF importance matrix."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as error:
        raise OptionError(f"{named('imatrix', path)}: not a GGUF importance matrix ({error})") from None
    kind = reader.fields.get("general.type")
    if kind is None or kind.contents() != "imatrix":
        raise OptionError(f"{named('imatrix', path)}: not a GGUF importance matrix (general.type is not imatrix)")
    sums = {t.name[: -len(".in_sum2")]: np.array(t.data) for t in reader.tensors if t.name.endswith(".in_sum2")}
    counts = {t.name[: -len(".counts")]: np.array(t.data) for t in reader.tensors if t.name.endswith(".counts")}
    return {name: (sums[name], counts[name].reshape(-1)) for name in sums if name in counts}


def _layer_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "blk" else None


def _layer_tokens(imatrix: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """Tokens each layer saw: the count of its router (or any dense tensor of the layer)."""
    tokens: dict[str, float] = {}
    for name, (_, counts) in sorted(imatrix.items(), key=lambda item: "ffn_gate_inp" not in item[0]):
        layer = _layer_of(name)
        if layer is not None and layer not in tokens and counts.size == 1:
            tokens[layer] = float(counts[0])
    return tokens


def importance_of(
    name: str,
    shape: tuple[int, ...],
    imatrix: dict[str, tuple[np.ndarray, np.ndarray]],
    layer_tokens: dict[str, float],
    experts_used: int,
) -> Importance:
    experts = shape[0] if len(shape) == 3 else 1
    cols = shape[-1]
    per_token = 1.0 / experts_used**2 if experts > 1 else 1.0
    entry = imatrix.get(name)
    if entry is not None and entry[0].reshape(-1, cols).shape[0] == experts:
        sums = torch.from_numpy(entry[0].reshape(experts, cols).astype(np.float64))
        counts = torch.from_numpy(entry[1].astype(np.float64)).reshape(-1)
        if counts.numel() == 1:
            counts = counts.expand(experts)
        columns = sums / counts.clamp_min(1).unsqueeze(-1)
        columns = torch.where(counts.unsqueeze(-1) > 0, columns, torch.ones_like(columns))
        mean = columns.mean(dim=-1, keepdim=True).clamp_min(1e-30)
        columns = columns.clamp_min(1e-6 * mean)
        tokens = layer_tokens.get(_layer_of(name) or "", float(counts.sum()) / (experts_used if experts > 1 else 1))
        share = counts / max(tokens, 1.0) * per_token if experts > 1 else torch.ones(1, dtype=torch.float64)
        return Importance(columns.float(), share.float(), True)
    share = torch.full((experts,), per_token * (experts_used / experts if experts > 1 else 1.0))
    if name == "token_embd.weight":
        share = torch.full((1,), 1.0 / shape[-2])
    return Importance(torch.ones(experts, cols), share, False)


def embedding_importance(
    shape: tuple[int, ...], tied: bool, imatrix: dict[str, tuple[np.ndarray, np.ndarray]]
) -> Importance:
    """The token embedding: one row per token (``1 / rows`` of the tensor's error per token), and where no
    ``output.weight`` exists it is also the output head, whose input statistics the imatrix holds as
    ``output.weight``."""
    if not tied:
        return importance_of("token_embd.weight", shape, {}, {}, 1)
    head = importance_of("output.weight", shape, imatrix, {}, 1)
    return Importance(head.columns, head.share + 1.0 / shape[-2], head.measured)


def floats(tensor: Any, expert: int | None, rows: slice | np.ndarray) -> torch.Tensor:
    """Rows of a float GGUF tensor (of one expert) as float32 ``[rows, cols]``."""
    data = tensor.data if expert is None else tensor.data[expert]
    part = np.asarray(data[rows])
    kind = tensor.tensor_type.name
    if kind == "BF16":
        bits = torch.from_numpy(np.ascontiguousarray(part).view(np.int16).copy())
        return bits.view(torch.bfloat16).float()
    return torch.from_numpy(part.astype(np.float32))


def logical_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


MAGNITUDE_WEIGHT = {"Q2_K": (1.0, 256), "Q3_K": (2.0, 256), "Q4_K": (2.0, 256), "Q5_K": (2.0, 256)}
"""llama.cpp's quantisers with an importance matrix weight each weight by ``importance * sqrt(sigma2 + x^2)``,
``sigma2`` that factor times the mean square over the super-block (``quantize_row_q*_K_impl``) or over the row
(the 32-wide types; ``None`` here); Q6_K and Q8_0 take the importance alone. On the 256-wide model with llama.cpp's
own Q2_K types this took llama-perplexity from 49.17 to 49.06 (llama-quantize: 49.03)."""
_ROW_MAGNITUDE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")


def _encode(type_name: str, weights: torch.Tensor, importance: torch.Tensor) -> dict[str, torch.Tensor]:
    fmt = FORMATS[type_name]
    w = importance.expand(weights.shape)
    if type_name in MAGNITUDE_WEIGHT or type_name in _ROW_MAGNITUDE:
        factor, span = MAGNITUDE_WEIGHT.get(type_name, (1.0, weights.shape[-1]))
        squares = (weights * weights).reshape(-1, span)
        sigma2 = factor * squares.mean(dim=-1, keepdim=True)
        w = w * torch.sqrt(sigma2 + squares).reshape(weights.shape)
    return fmt.encode(weights.reshape(-1, fmt.block), w.reshape(-1, fmt.block))


def _row_chunks(rows: int, cols: int) -> Iterator[slice]:
    step = max(1, CHUNK_WEIGHTS // cols)
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def measure(tensor: Any, shape: tuple[int, ...], types: list[str], importance: Importance) -> dict[str, float]:
    """Each type's weighted error on evenly spaced sample rows (per expert), relative to the tensor's weighted
    output power on the same rows (``sum_e p_e sum E[x^2] W^2``)."""
    experts = shape[0] if len(shape) == 3 else 1
    rows = shape[-2]
    budget = SAMPLE_ROWS if experts > 1 else 4 * SAMPLE_ROWS
    picked = np.unique(np.linspace(0, rows - 1, min(rows, budget)).round().astype(np.int64))
    scale = rows / len(picked)
    errors, power = dict.fromkeys(types, 0.0), 0.0
    for expert in range(experts):
        weights = floats(tensor, expert if len(shape) == 3 else None, picked)
        columns = importance.columns[expert]
        share = float(importance.share[expert])
        if share == 0:
            continue
        power += share * scale * (weights**2 * columns).sum().item()
        for type_name in types:
            fields = _encode(type_name, weights, columns)
            values = FORMATS[type_name].decode(fields).reshape(weights.shape)
            error = ((weights - values) ** 2 * columns).sum().item()
            errors[type_name] += share * scale * error
    return {type_name: error / power if power > 0 else 0.0 for type_name, error in errors.items()}


def encode_tensor(tensor: Any, shape: tuple[int, ...], type_name: str, importance: Importance) -> Iterator[np.ndarray]:
    """The tensor's GGML blocks in file order, a chunk of rows at a time."""
    fmt = FORMATS[type_name]
    experts = shape[0] if len(shape) == 3 else 1
    for expert in range(experts):
        for rows in _row_chunks(shape[-2], shape[-1]):
            weights = floats(tensor, expert if len(shape) == 3 else None, rows)
            fields = _encode(type_name, weights, importance.columns[expert])
            yield ggml_bytes(fmt, *split(fmt, fields)).numpy()


def fingerprint(rows: Iterator[torch.Tensor], shape: tuple[int, ...]) -> str:
    """A tensor's identity across the converter: its float32 values (given a chunk of rows at a time) and shape."""
    digest = hashlib.sha256(repr(tuple(shape)).encode())
    for part in rows:
        digest.update(part.float().contiguous().numpy().tobytes())
    return digest.hexdigest()


class KeptBlocks:
    """The GGML blocks of the dense tensors the quantisation pass quantised (attention, shared experts, the head),
    saved while the converter's view is written and found again in the converter's file by their values: a float
    tensor there whose values are exactly what we dequantised to is written as our blocks, not re-encoded."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.found: dict[tuple[str, tuple[int, ...]], tuple[str, Path, str]] = {}

    def add(self, key: str, q: Any, dequantized: torch.Tensor) -> None:
        from . import ggml_blocks

        if q.salient is not None or len(q.shape) != 2:
            return
        try:
            type_name = ggml_blocks.ggml_type_for(q)
        except ValueError:
            return
        shape = tuple(q.shape)
        chunks = (dequantized[rows] for rows in _row_chunks(shape[0], shape[1]))
        mark = fingerprint(chunks, shape)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{mark}.blocks"
        with open(path, "wb", buffering=0) as handle:
            for chunk in ggml_blocks.ggml_chunks(q):
                write_chunk(handle, np.ascontiguousarray(chunk).reshape(-1).view(np.uint8))
        self.found[(mark, shape)] = (type_name, path, key)

    def match(self, tensor: Any, shape: tuple[int, ...]) -> tuple[str, Path, str] | None:
        if len(shape) != 2 or not any(known == shape for _, known in self.found):
            return None
        mark = fingerprint((floats(tensor, None, rows) for rows in _row_chunks(*shape)), shape)
        return self.found.get((mark, shape))


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@dataclass
class Entry:
    """One tensor of the file and what becomes of it: ``type_name`` None keeps its bytes as they are."""

    index: int
    name: str
    shape: tuple[int, ...]
    source_type: str
    type_name: str | None = None
    why: str = ""
    options: list[Option] = field(default_factory=list)
    importance: Importance | None = None
    blocks: Path | None = None

    @property
    def nbytes(self) -> int:
        return gguf_types.nbytes(self.type_name, self.shape) if self.type_name else -1


class Retyper:
    """Plans and writes the re-typed copy of one GGUF file."""

    def __init__(self, path: Path, request: Request, kept: KeptBlocks | None = None):
        import gguf

        self.request = request
        self.reader = gguf.GGUFReader(path)
        arch = self.reader.fields["general.architecture"].contents()
        used = self.reader.fields.get(f"{arch}.expert_used_count")
        self.experts_used = int(used.contents()) if used is not None else 1
        self.imatrix = read_imatrix(request.imatrix) if request.imatrix else {}
        self.layer_tokens = _layer_tokens(self.imatrix)
        self.tied = all(tensor.name != "output.weight" for tensor in self.reader.tensors)
        blocks = self.reader.fields.get(f"{arch}.block_count")
        self.contributions = 2 * int(blocks.contents()) if blocks is not None else 1
        self.kept = kept
        self.entries = [self._entry(index, tensor) for index, tensor in enumerate(self.reader.tensors)]

    def _entry(self, index: int, tensor: Any) -> Entry:
        shape = logical_shape(tensor)
        entry = Entry(index, tensor.name, shape, tensor.tensor_type.name)
        if entry.source_type not in gguf_types.FLOAT_TYPES:
            entry.why = "already in a GGML block type (written as it is)"
            return entry
        if not gguf_types.quantisable(tensor.name, len(shape)):
            entry.why = "llama.cpp keeps it unquantised"
            return entry
        ours = None if self.kept is None else self.kept.match(tensor, shape)
        if ours is not None:
            entry.type_name, entry.blocks, key = ours
            entry.why = f"the quantisation pass's own blocks of {key}"
            return entry
        pinned = gguf_types.pinned_type(self.request.pins, tensor.name)
        if pinned == "keep":
            entry.why = "pinned: keep"
            return entry
        if pinned is not None:
            stored = gguf_types.stored_type(pinned, shape[-1])
            if stored is None:
                raise OptionError(
                    f"{named('tensor_type')}: {tensor.name} rows are {shape[-1]} wide, which {pinned} cannot hold"
                )
            entry.type_name, entry.why = stored, f"pinned {pinned}"
        else:
            candidates = {gguf_types.stored_type(t, shape[-1]) for t in gguf_types.CHOICES} - {None}
            if not candidates:
                entry.why = f"rows {shape[-1]} wide fit no block type"
                return entry
            entry.options = [Option(t, _padded(gguf_types.nbytes(t, shape)), math.inf) for t in sorted(candidates)]
            default = gguf_types.stored_type(self.request.default_type, shape[-1])
            entry.type_name, entry.why = default, "default"
        if tensor.name == "token_embd.weight":
            entry.importance = embedding_importance(shape, self.tied, self.imatrix)
        else:
            entry.importance = importance_of(tensor.name, shape, self.imatrix, self.layer_tokens, self.experts_used)
        return entry

    def _fixed_bytes(self) -> int:
        return sum(
            _padded(int(self.reader.tensors[e.index].n_bytes) if e.type_name is None else e.nbytes)
            for e in self.entries
            if not e.options
        )

    def _overhead(self) -> int:
        longest = max((len(t) for t in gguf_types.PINNABLE), default=6)
        names = [e.name for e in self.entries if e.options or e.type_name]
        kv = len(json.dumps(dict.fromkeys(names, "x" * longest))) + 2 * 64
        return _padded(int(self.reader.data_offset) + kv + 64)

    def data_budget(self) -> int | None:
        """Bytes the chosen tensors may take: the target less the header, metadata and every other tensor."""
        if self.request.target_bytes is not None:
            return self.request.target_bytes - self._overhead() - self._fixed_bytes()
        if self.request.target_bpw is not None:
            weights = sum(math.prod(e.shape) for e in self.entries)
            return int(self.request.target_bpw * weights / 8) - self._fixed_bytes()
        return None

    def plan(self, progress: bool = True) -> dict[str, Any]:
        choosing = [e for e in self.entries if e.options]
        budget = self.data_budget()
        if budget is None or not choosing:
            for entry in choosing:
                entry.options = []
            return {}
        least = smallest({e.name: e.options for e in choosing})
        if budget < least:
            asked = (
                named("target_size", self.request.target_bytes)
                if self.request.target_bytes is not None
                else named("target_bpw", self.request.target_bpw)
            )
            raise OptionError(
                f"{asked}: too small: the fixed part takes {self._fixed_bytes() + self._overhead()} bytes and the "
                f"smallest types {least} more"
            )
        for entry in progress_bar(choosing, desc="measuring types", unit="tensor", disable=not progress):
            tensor = self.reader.tensors[entry.index]
            errors = measure(tensor, entry.shape, [o.type_name for o in entry.options], entry.importance)
            share = 1.0 / self.contributions if _layer_of(entry.name) is not None else 1.0
            entry.options = [Option(o.type_name, o.nbytes, share * errors[o.type_name]) for o in entry.options]
        chosen = allocate({e.name: e.options for e in choosing}, budget)
        for entry in choosing:
            entry.type_name, entry.why = chosen[entry.name].type_name, "allocated"
        spent = sum(chosen[e.name].nbytes for e in choosing)
        return {"data_budget": budget, "spent": spent, "smallest_possible": least}

    @property
    def changes(self) -> bool:
        return any(entry.type_name for entry in self.entries)

    def file_type(self) -> int | None:
        """``general.file_type``: as the file has it where our expert blocks are in it already (the converter was
        given theirs); otherwise that of the type holding the most weights."""
        import gguf

        from .to_gguf import FILE_TYPES

        if any(entry.source_type not in gguf_types.FLOAT_TYPES for entry in self.entries):
            return None
        weights: dict[str, int] = {}
        for entry in self.entries:
            kind = entry.type_name or entry.source_type
            weights[kind] = weights.get(kind, 0) + math.prod(entry.shape)
        for kind in sorted(weights, key=weights.get, reverse=True):
            if kind in FILE_TYPES:
                return int(gguf.LlamaFileType[FILE_TYPES[kind]])
        return None

    def write(self, out: Path, progress: bool = True) -> dict[str, Any]:
        import gguf

        arch = self.reader.fields["general.architecture"].contents()
        writer = gguf.GGUFWriter(out, arch, endianess=self.reader.endianess)
        types = {e.name: e.type_name for e in self.entries if e.type_name}
        file_type = self.file_type()
        for name, item in self.reader.fields.items():
            if name == gguf.Keys.General.ARCHITECTURE or name.startswith("GGUF.") or name in (TYPES_KEY, TARGET_KEY):
                continue
            value = item.contents()
            if name == gguf.Keys.General.FILE_TYPE and file_type is not None:
                value = file_type
            sub_type = item.types[-1] if item.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(name, value, item.types[0], sub_type=sub_type)
        writer.add_string(TYPES_KEY, json.dumps(types, separators=(",", ":")))
        if self.request.target_bytes is not None:
            writer.add_uint64(TARGET_KEY, self.request.target_bytes)
        for entry in self.entries:
            tensor = self.reader.tensors[entry.index]
            if entry.type_name is None:
                writer.add_tensor_info(
                    tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
                )
            else:
                block, block_bytes = FORMATS[entry.type_name].block, FORMATS[entry.type_name].block_bytes
                byte_shape = (*entry.shape[:-1], entry.shape[-1] // block * block_bytes)
                writer.add_tensor_info(
                    tensor.name,
                    byte_shape,
                    np.dtype(np.uint8),
                    entry.nbytes,
                    gguf.GGMLQuantizationType[entry.type_name],
                )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        handle = writer.fout[0]
        for entry in progress_bar(self.entries, desc="writing GGML blocks", unit="tensor", disable=not progress):
            tensor = self.reader.tensors[entry.index]
            writer.write_padding(handle, handle.tell())
            written = 0
            if entry.blocks is not None:
                with open(entry.blocks, "rb") as source:
                    while chunk := source.read(1 << 24):
                        write_chunk(handle, chunk)
                        written += len(chunk)
            elif entry.type_name is None:
                write_chunk(handle, np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8))
                written = tensor.data.nbytes
            else:
                for chunk in encode_tensor(tensor, entry.shape, entry.type_name, entry.importance):
                    write_chunk(handle, np.ascontiguousarray(chunk).reshape(-1))
                    written += chunk.nbytes
            expected = tensor.data.nbytes if entry.type_name is None else entry.nbytes
            if written != expected:
                raise RuntimeError(f"{entry.name}: wrote {written} bytes, not the {expected} announced")
            writer.write_padding(handle, written)
        writer.close()
        return self.report()

    def report(self) -> dict[str, Any]:
        tensors = {}
        for entry in self.entries:
            if entry.type_name is None and not entry.why.startswith("pinned"):
                continue
            item: dict[str, Any] = {"type": entry.type_name or entry.source_type, "why": entry.why}
            if entry.type_name:
                item["bytes"] = entry.nbytes
            if entry.options and all(math.isfinite(o.error) for o in entry.options):
                item["error_by_type"] = {o.type_name: o.error for o in entry.options}
            if entry.importance is not None:
                item["importance"] = "imatrix" if entry.importance.measured else "uniform (not in the imatrix)"
            tensors[entry.name] = item
        return {"tensors": tensors}
