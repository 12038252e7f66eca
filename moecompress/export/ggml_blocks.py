"""Our quantised expert matrices as GGML block tensors, and how far GGML's values are from ours.

GGML blocks hold 32 consecutive weights of a row; a 4-bit block stores weight ``j`` in the low nibble of byte
``j`` and weight ``j + 16`` in its high nibble (ours: weights ``2k`` and ``2k + 1`` share byte ``k``).

- MXFP4 → ``MXFP4`` (``block_mxfp4``: the E8M0 scale byte, then 16 bytes of E2M1 codes). GGML's code table is
  ours doubled and its scale ``2**(e - 127) / 2``, so the codes and the scale byte copy over unchanged: exact.
- Integer grids (INT4/INT2, binary) → ``Q4_0`` (``d`` fp16, value ``(q - 8)·d``) when the zero point is fixed,
  ``Q4_1`` (``d``, ``m`` fp16, value ``q·d + m``) when it is stored per group. A group of 64 or 128 becomes 2 or 4
  blocks with the same scale. The codes map exactly (``q = code - z + 8`` for Q4_0); the differences are the fp16
  rounding of a bf16 scale outside fp16's range (or subnormal), of Q4_1's ``m = -z·s``, and our rounding of the
  product to bf16, which GGML does not do. :func:`measure` reports them.
- GGML's k-quants (``Q2_K`` .. ``Q6_K``) and the 32-weight types they fall back to at other widths (``Q4_0``,
  ``Q5_0``, ``Q5_1``, ``Q8_0``): we store GGML's own block fields, so the blocks are those fields joined in GGML's
  order (the scheme's ``ggml_blocks``): exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.packing import pack_codes
from ..quantization.scheme import QuantizedTensor, QuantScheme
from ..quantization.schemes.ggml_blocks import FORMATS

QK = 32


@dataclass(frozen=True)
class GGMLTensor:
    """Raw GGML blocks ``[..., rows, cols / 32 * block_bytes]`` (uint8) of a ``[..., rows, cols]`` weight."""

    type_name: str
    blocks: np.ndarray


BLOCKS = {
    "MXFP4": (QK, 1 + QK // 2),
    "Q4_0": (QK, 2 + QK // 2),
    "Q4_1": (QK, 4 + QK // 2),
    **{name: (fmt.block, fmt.block_bytes) for name, fmt in FORMATS.items()},
}
"""GGML type name -> (weights per block, bytes per block), for every type the export writes."""


def ggml_type(scheme: QuantScheme, has_zeros: bool, cols: int) -> str:
    """The GGML block type that holds ``scheme``'s weights with ``cols`` inputs."""
    type_name = scheme.kind.ggml_block_type(scheme, has_zeros, cols)
    if type_name is None:
        raise ValueError(f"{scheme.name} has no GGML block type")
    return type_name


def ggml_type_for(q: QuantizedTensor) -> str:
    return ggml_type(q.scheme, q.zeros is not None, q.shape[-1])


def byte_shape(type_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of :attr:`GGMLTensor.blocks` for a ``shape`` weight."""
    block, block_bytes = BLOCKS[type_name]
    return (*shape[:-1], shape[-1] // block * block_bytes)


def _ggml_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[..., n·32]`` → GGML's packing ``[..., n, 16]`` (weight j low, j + 16 high)."""
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, QK)
    return grouped[..., : QK // 2] | (grouped[..., QK // 2 :] << 4)


def _per_block(scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group values ``[..., cols / group]`` repeated for each 32-wide block of the group."""
    return scales.repeat_interleave(group_size // QK, dim=-1)


def _fp16_bits(values: torch.Tensor) -> np.ndarray:
    return values.to(torch.float16).contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)


_LOW = np.uint64(0x0F0F0F0F0F0F0F0F)


def _repacked_nibbles(packed: np.ndarray, out: np.ndarray) -> None:
    """GGML's 16 nibble bytes per block of our packed 4-bit codes (``[n, 16]`` uint8, contiguous) into ``out``
    (``[n, 8]`` uint16), without unpacking. Our bytes ``0..7`` of a block (``first``) hold weights ``0..15``, bytes
    ``8..15`` (``second``) weights ``16..31``; GGML's byte ``2m`` is the low nibbles of ``first[m]`` and
    ``second[m]``, its byte ``2m + 1`` their high nibbles. Both are formed eight bytes at a time in a uint64 and then
    interleaved as the low and high bytes of uint16s."""
    halves = packed.view(np.uint64)
    first, second = halves[:, 0], halves[:, 1]
    lows = (first & _LOW) | ((second & _LOW) << np.uint64(4))
    highs = ((first >> np.uint64(4)) & _LOW) | (second & ~_LOW)
    np.copyto(out, highs.view(np.uint8).reshape(-1, 8))
    out <<= 8
    out |= lows.view(np.uint8).reshape(-1, 8)


def _quants_are_codes(q: QuantizedTensor) -> bool:
    """Whether GGML's 4-bit quants are our stored codes: MXFP4, and 4-bit integer grids (``code - 8 + 8`` for
    Q4_0, the code itself for Q4_1)."""
    return q.scheme.bits == 4


def block_dtype(type_name: str) -> np.dtype:
    """One GGML block as a packed record: the scale fields (``e`` the E8M0 byte; ``d``, ``m`` fp16 bits), then the
    16 bytes of quants."""
    head = {"MXFP4": [("e", "u1")], "Q4_0": [("d", "<u2")], "Q4_1": [("d", "<u2"), ("m", "<u2")]}[type_name]
    return np.dtype([*head, ("qs", "V16")])


CHUNK_BYTES = 1 << 21
"""About how many bytes of our codes one chunk re-packs: small enough for its temporaries to stay in cache."""


def _row_chunks(rows: int, cols: int) -> list[slice]:
    step = max(1, CHUNK_BYTES // max(1, cols // 2))
    return [slice(start, min(rows, start + step)) for start in range(0, rows, step)]


def ggml_chunks(q: QuantizedTensor) -> Iterator[np.ndarray]:
    """``q`` (salient weights not allowed: GGML has no place for them) as GGML blocks, in file order, a few rows at a
    time: each chunk a 1-D array of :func:`block_dtype` records, overwritten by the next one. ``q``'s tensors may be
    views (rows of a fused matrix) or memory-mapped: a chunk reads only its rows."""
    if q.salient is not None:
        raise ValueError("a matrix with salient weights has no GGML block type; fold it into a dense tensor")
    type_name = ggml_type_for(q)
    scheme = q.scheme
    lead, rows, cols = math.prod(q.shape[:-2]), math.prod(q.shape[-2:-1]), q.shape[-1]
    if scheme.kind.ggml_own_blocks:
        yield from _stored_block_chunks(q, lead, rows)
        return
    dtype = block_dtype(type_name)
    if _quants_are_codes(q):
        packed, nibbles = q.packed.reshape(lead, rows, -1), None
    else:
        quants = scheme.kind.ggml_quants(scheme, q.codes(), type_name)
        packed, nibbles = None, _ggml_nibbles(quants.to(torch.uint8)).reshape(lead, rows, -1)
    scales = q.scales.reshape(lead, rows, -1)
    zeros = None if q.zeros is None else q.zeros.reshape(lead, rows, -1)
    chunks = _row_chunks(rows, cols)
    if not chunks or cols == 0:
        return
    wide = np.empty((chunks[0].stop * (cols // QK), QK // 4), np.uint16)
    buffer = np.empty(len(wide), dtype)
    for index in range(lead):
        for part in chunks:
            out = buffer[: (part.stop - part.start) * (cols // QK)]
            if packed is not None:
                codes = np.ascontiguousarray(packed[index, part].numpy()).reshape(-1, QK // 2)
                quants = wide[: len(out)]
                _repacked_nibbles(codes, quants)
                out["qs"] = quants.view("V16").reshape(-1)
            else:
                out["qs"] = np.ascontiguousarray(nibbles[index, part].numpy()).view("V16").reshape(-1)
            block_scales = scales[index, part]
            if type_name == "MXFP4":
                out["e"] = block_scales.numpy().reshape(-1)
            else:
                scale = block_scales.float()
                out["d"] = _fp16_bits(_per_block(scale, scheme.group_size))
                if type_name == "Q4_1":
                    out["m"] = _fp16_bits(_per_block(-(zeros[index, part].float() * scale), scheme.group_size))
            yield out


def _stored_block_chunks(q: QuantizedTensor, lead: int, rows: int) -> Iterator[np.ndarray]:
    """The blocks (uint8) of a scheme that stores GGML's own block fields, a few rows at a time."""
    cols = q.shape[-1]
    packed, scales = q.packed.reshape(lead, rows, -1), q.scales.reshape(lead, rows, -1)
    for index in range(lead):
        for part in _row_chunks(rows, cols):
            rows_q = QuantizedTensor(q.scheme, (part.stop - part.start, cols), packed[index, part], scales[index, part])
            _, blocks = q.scheme.kind.ggml_blocks(rows_q)
            yield blocks.numpy().reshape(-1)


def to_ggml(q: QuantizedTensor) -> GGMLTensor:
    """``q`` as GGML blocks, whole (:func:`ggml_chunks` joined)."""
    type_name = ggml_type_for(q)
    blocks = np.concatenate([np.empty(0, np.uint8), *(chunk.view(np.uint8).copy() for chunk in ggml_chunks(q))])
    return GGMLTensor(type_name, blocks.reshape(byte_shape(type_name, tuple(q.shape))))


@dataclass(frozen=True)
class BlockError:
    """How GGML's dequantised values differ from ours over one matrix (all zero: exact)."""

    max_abs: float
    max_rel: float
    """Largest ``|ggml - ours| / |ours|`` over the weights where ours is non-zero."""
    mismatched: int
    numel: int

    @property
    def exact(self) -> bool:
        return self.mismatched == 0

    def to_dict(self) -> dict[str, float | int | bool]:
        return {
            "exact": self.exact,
            "max_abs_error": self.max_abs,
            "max_rel_error": self.max_rel,
            "mismatched_weights": self.mismatched,
            "weights": self.numel,
        }


def ggml_dequantize(tensor: GGMLTensor) -> np.ndarray:
    """GGML's float32 values of ``tensor``, by the gguf package's own reference (``gguf.quants``)."""
    import gguf

    return gguf.quants.dequantize(tensor.blocks, gguf.GGMLQuantizationType[tensor.type_name])


def compare(ggml_values: np.ndarray, ours: torch.Tensor) -> BlockError:
    theirs = torch.from_numpy(np.ascontiguousarray(ggml_values)).float().reshape(ours.shape)
    ours = ours.float()
    diff = (theirs - ours).abs()
    nonzero = ours != 0
    rel = diff[nonzero] / ours[nonzero].abs()
    return BlockError(
        float(diff.max()) if diff.numel() else 0.0,
        float(rel.max()) if rel.numel() else 0.0,
        int((diff > 0).sum()),
        ours.numel(),
    )


def _distinct_rows(columns: list[torch.Tensor]) -> torch.Tensor:
    """The distinct rows, by their bits, of the same-shaped tensors ``columns`` side by side: ``[n, bytes]``
    (at most 7 bytes in all)."""
    raw = torch.cat([c.reshape(-1, 1).contiguous().view(torch.uint8) for c in columns], dim=1)
    width = raw.shape[1]
    if width == 1:
        distinct = torch.bincount(raw[:, 0], minlength=256).nonzero().squeeze(1)
    else:
        key = torch.zeros(raw.shape[0], dtype=torch.int64)
        for byte in range(width):
            key |= raw[:, byte].to(torch.int64) << (8 * byte)
        distinct = torch.bincount(key, minlength=1 << 16).nonzero().squeeze(1) if width == 2 else torch.unique(key)
    return torch.stack([(distinct >> (8 * byte)).to(torch.uint8) for byte in range(width)], dim=1)


def _every_group(q: QuantizedTensor) -> QuantizedTensor | None:
    """A weight with one row per distinct group (scale, and zero point where stored) of ``q``, holding every code:
    each weight's value is a function of its code and its group alone, in GGML's decoding and in ours, so comparing
    the two on it compares every value ``q`` can hold. None where it would not be smaller than ``q``."""
    scheme = q.scheme
    columns = [q.scales] if q.zeros is None else [q.scales, q.zeros]
    rows = _distinct_rows(columns)
    if rows.shape[0] * scheme.group_size >= q.numel:
        return None
    width = q.scales.element_size()
    scales = rows[:, :width].contiguous().view(q.scales.dtype)
    zeros = None if q.zeros is None else rows[:, width:].contiguous().view(q.zeros.dtype)
    codes = (torch.arange(scheme.group_size) % (1 << scheme.bits)).expand(rows.shape[0], -1)
    return QuantizedTensor(scheme, tuple(codes.shape), pack_codes(codes, scheme.bits), scales, zeros)


def measure(q: QuantizedTensor, tensor: GGMLTensor | None = None) -> BlockError:
    """GGML's values of ``tensor`` (``q``'s blocks, made here if not given) against ``q.dequantize()`` (what our model
    computes with). Where GGML's decoding of every (code, group) pair ``q`` has equals ours (MXFP4 always), the whole
    matrix is exact without decoding it; otherwise every weight is decoded both ways and compared. The table is small:
    it is decoded by the reference (bit-identical to the kernels, which would cost a second to load). A scheme that
    stores GGML's own block fields has no such table: every weight is compared."""
    table = None if q.scheme.kind.ggml_own_blocks else _every_group(q)
    if table is not None and compare(ggml_dequantize(to_ggml(table)), table._dequantize_reference()).exact:
        return BlockError(0.0, 0.0, 0, q.numel)
    return compare(ggml_dequantize(tensor if tensor is not None else to_ggml(q)), q.dequantize())
