"""Golomb and Rice coding of sparse bitmaps: the salient-weight masks that sit beside ~1-bit weights.

A bitmap of ``n`` positions with ``c`` set bits is coded as ``c + 1`` symbols: the run of zeros before each set
bit, then the trailing run after the last one. A symbol ``r`` is split by the code's modulus ``m`` into a
quotient ``q = r // m``, written in unary, and a remainder ``r % m``, written in binary: ``k`` bits for Rice
(``m = 2**k``), a truncated binary code of ``b - 1`` or ``b`` bits for Golomb (``b = ceil(log2 m)``). For a
bitmap whose ones are independent with probability ``p`` the runs are geometric, and these codes cost within a
fraction of a percent (Golomb) or a few percent (Rice) of the entropy ``n·H(p)``.

Parameters. Rice takes the ``k`` that gives the smallest output for the bitmap at hand, trying the few values
around ``log2`` of the mean run. Golomb takes Gallager and Van Voorhis' optimum for a geometric source,
``m = ceil(log(2 - p) / -log(1 - p))`` with ``p`` the bitmap's own density. An explicit ``parameter`` (``k`` or
``m``) overrides either.

The trailing run. Its quotient is coded; its remainder is not, because the header's ``n`` gives it. That costs
``1 + t // m`` bits (about 1.5 on average), and it is what lets a decoder refuse a huge ``n`` from a small
input: every symbol costs at least one unary bit per ``m`` positions, so a valid input satisfies
``n - c < m * unary_bits``, checked from the header and the input's size, and the runs must then add up to
``n`` with the trailing quotient exactly. Decoding allocates in proportion to the input (a few 8-byte words per
payload bit at most) until that has been checked; only :func:`decode`'s bool output then takes ``n`` bytes. A
genuine encoding of a long, nearly empty bitmap is still tiny (all zeros of 2**40 positions is a 51-byte Rice
container), so ``decode`` takes ``max_length`` to refuse what the caller cannot hold;
``decode_indices`` never allocates ``n`` anything. Lengths are limited to 2**40 positions, ``k`` to 40 and
``m`` to 2**40.

Container layout, all integers little-endian::

    offset  size  field
    0       4     magic b"MCGR"
    4       1     format version, 1
    5       1     code: 0 Rice, 1 Golomb
    6       8     parameter: k (Rice) or m (Golomb), u64
    14      8     n, bitmap length in positions, u64
    22      8     c, number of set bits, u64
    30      4     N, symbols per chunk, u32
    34      C*E   chunk table: C = ceil((c + 1) / N) entries of E bytes, E = 16 (Rice) or 24 (Golomb)
    34+C*E  ...   payload, to the end of the buffer

Chunk ``j`` holds symbols ``j*N .. (j+1)*N - 1``. Its table entry is the bitmap position where its first run
starts, the payload bit offset of its first quotient and, for Golomb, the payload bit offset of its first
extension bit, each u64. With those a chunk decodes on its own (:func:`decode_indices` with ``chunks``).

The payload is one bit string, most significant bit of each byte first (``numpy.packbits`` order), padded with
zero bits to a whole byte, in three sections:

1. remainders: the ``w`` bits of each of the ``c`` fixed-width remainder fields, stored as ``w`` bit planes,
   most significant plane first, each plane holding one bit of every symbol in order (``w = k`` for Rice,
   ``b - 1`` for Golomb, where ``m = 1`` has no remainder at all);
2. extension bits (Golomb only): for each symbol whose field ``x`` is at least ``u = 2**b - m``, in order, the
   last bit of its truncated binary codeword, so that the remainder is ``x`` when ``x < u`` and
   ``2*x + bit - u`` otherwise;
3. quotients: ``c + 1`` unary codes, ``q`` zero bits then a one.

Nothing else is stored: the sections' sizes follow from the header and table, and a decoder insists on every
one of them, on the zero padding, on the table's entries and on ``n`` and ``c``, so each bitmap (given the code,
parameter and ``N``) has exactly one encoding. The fixed overhead beside the payload is ``34 + C*E`` bytes.

Implementation: vectorised numpy, no JIT and no new dependency; no Python loop runs per symbol (loops run per
bit plane, per word of a block of 8 symbols, or per output block).
Decoding runs ``np.flatnonzero`` over the unary bits for the terminators ``T_i``. The bit planes fill small
unsigned lanes packed 8, 4, 2 or 1 to a uint64, so one word shift-or handles that many fields. Golomb's
extension bits are dealt into their symbols a byte of 8 symbols at a time, through a 64 Ki-entry table indexed
by (which of the 8 take a bit, the next 8 bits). Positions are ``m*T_i - (m-1)*i + R_i`` with ``R_i`` the
running sum of remainders, done as a prefix sum inside each word (one multiplication by the all-ones word) plus
one term per block of 8 symbols. The bool output is zeroed and filled in cache-sized blocks. numba was tried
first: a straightforward njit decoder reading the unary code a bit at a time (a branch per bit) was slower than
this at p = 0.05. A word-at-a-time one was not tried; it would bring compile time and a second decoder to keep
in step with this one. Measurements: docs/golomb_rice.md.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

MAGIC = b"MCGR"
VERSION = 1
HEADER = struct.Struct("<4sBBQQQI")
HEADER_SIZE = HEADER.size
CODES = ("rice", "golomb")
ENTRY_FIELDS = {"rice": 2, "golomb": 3}
DEFAULT_CHUNK_SYMBOLS = 1 << 16
MAX_CHUNK_SYMBOLS = (1 << 32) - 1
MAX_LENGTH = 1 << 40
MAX_RICE_K = 40
MAX_GOLOMB_M = 1 << 40

Code = Literal["rice", "golomb"]


@dataclass(frozen=True)
class _Scheme:
    """A code and parameter resolved into the payload's field layout."""

    code: Code
    parameter: int
    modulus: int
    width: int
    cutoff: int
    extended: bool


def _scheme(code: str, parameter: int) -> _Scheme:
    if code == "rice":
        if not 0 <= parameter <= MAX_RICE_K:
            raise ValueError(f"Rice parameter k must be in [0, {MAX_RICE_K}], got {parameter}")
        return _Scheme("rice", parameter, 1 << parameter, parameter, 0, False)
    if code == "golomb":
        if not 1 <= parameter <= MAX_GOLOMB_M:
            raise ValueError(f"Golomb parameter m must be in [1, {MAX_GOLOMB_M}], got {parameter}")
        bits = (parameter - 1).bit_length()
        if bits == 0:
            return _Scheme("golomb", parameter, 1, 0, 0, False)
        return _Scheme("golomb", parameter, parameter, bits - 1, (1 << bits) - parameter, True)
    raise ValueError(f"unknown code {code!r}; expected one of {CODES}")


@dataclass(frozen=True)
class CodedSize:
    """Footprint of one bitmap under one code, in bits unless named otherwise: the raw bitmap's ``n``, the coded
    payload (without its zero padding), the whole container in bytes and the entropy bound ``n·H(c/n)``."""

    code: Code
    parameter: int
    positions: int
    ones: int
    raw_bits: int
    payload_bits: int
    container_bytes: int
    entropy_bits: float

    @property
    def overhead_bytes(self) -> int:
        """Header and chunk table: the container's fixed cost beside the payload."""
        return self.container_bytes - (self.payload_bits + 7) // 8

    @property
    def ratio_to_entropy(self) -> float:
        return self.payload_bits / self.entropy_bits if self.entropy_bits else math.inf


def entropy_bits(positions: int, ones: int) -> float:
    """``n·H(c/n)``: the Shannon bound, in bits, for a bitmap of this length and density."""
    if ones in (0, positions):
        return 0.0
    p = ones / positions
    return positions * -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


# --- encoding ------------------------------------------------------------------------------------------------


def _set_bits(bits: npt.ArrayLike) -> tuple[npt.NDArray[np.int64], int]:
    """The positions of the set bits of a 1-D bool bitmap (an empty sequence is an empty bitmap), and its length."""
    array = np.asarray(bits)
    if array.ndim != 1:
        raise ValueError(f"bitmap must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype != np.bool_:
        raise TypeError(f"bitmap must hold bools, got dtype {array.dtype}")
    if array.size > MAX_LENGTH:
        raise ValueError(f"bitmap longer than {MAX_LENGTH} positions")
    return np.flatnonzero(array), array.size


def _as_indices(indices: npt.ArrayLike, length: int) -> npt.NDArray[np.int64]:
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
        raise TypeError(f"length must be an integer, got {type(length).__name__}")
    if not 0 <= length <= MAX_LENGTH:
        raise ValueError(f"length must be in [0, {MAX_LENGTH}], got {length}")
    array = np.asarray(indices)
    if array.ndim != 1:
        raise ValueError(f"indices must be one-dimensional, got shape {array.shape}")
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"indices must be integers, got dtype {array.dtype}")
    if array[0] < 0 or array[-1] >= length:
        raise ValueError(f"indices must lie in [0, {length})")
    array = array.astype(np.int64)
    if array.size > 1 and not (array[1:] > array[:-1]).all():
        raise ValueError("indices must be strictly increasing")
    return array


def _runs(indices: npt.NDArray[np.int64], length: int) -> tuple[npt.NDArray[np.int64], int]:
    """The run of zeros before each set bit, and the trailing run."""
    runs = np.diff(indices, prepend=-1) - 1
    trailing = length - 1 - int(indices[-1]) if indices.size else length
    return runs, trailing


def _rice_parameter(runs: npt.NDArray[np.int64], trailing: int) -> int:
    """The ``k`` that codes these runs in the fewest bits, among those near ``log2`` of the mean run."""
    mean = (int(runs.sum()) + trailing) / (runs.size + 1)
    centre = math.floor(math.log2(mean)) if mean >= 1 else 0
    candidates = range(max(0, centre - 2), min(MAX_RICE_K, centre + 2) + 1)

    def total_bits(k: int) -> int:
        return runs.size * k + int((runs >> k).sum()) + (trailing >> k)

    return min(candidates, key=total_bits)


def _golomb_parameter(positions: int, ones: int) -> int:
    """Gallager and Van Voorhis' optimal ``m`` for a geometric source with the bitmap's density."""
    if ones == 0:
        return min(positions + 1, MAX_GOLOMB_M)
    if ones == positions:
        return 1
    p = ones / positions
    modulus = math.ceil(math.log(2 - p) / -math.log1p(-p))
    return min(max(modulus, 1), MAX_GOLOMB_M)


def _choose_scheme(
    code: str, parameter: int | None, runs: npt.NDArray[np.int64], trailing: int, length: int
) -> _Scheme:
    if code not in CODES:
        raise ValueError(f"unknown code {code!r}; expected one of {CODES}")
    if parameter is None:
        if code == "rice":
            parameter = _rice_parameter(runs, trailing)
        else:
            parameter = _golomb_parameter(length, runs.size)
    elif isinstance(parameter, bool) or not isinstance(parameter, (int, np.integer)):
        raise TypeError(f"parameter must be an integer, got {type(parameter).__name__}")
    return _scheme(code, int(parameter))


def _split(scheme: _Scheme, runs: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    if scheme.code == "rice":
        return runs >> scheme.parameter, runs & (scheme.modulus - 1)
    return np.divmod(runs, scheme.modulus)


def _fields(scheme: _Scheme, remainders: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Fixed-width fields and the extension bits of the symbols that have one (Golomb's truncated binary)."""
    if not scheme.extended:
        return remainders, np.zeros(0, dtype=bool)
    long_codes = remainders >= scheme.cutoff
    shifted = remainders + scheme.cutoff
    fields = np.where(long_codes, shifted >> 1, remainders)
    return fields, (shifted[long_codes] & 1).astype(bool)


def _table(
    scheme: _Scheme,
    indices: npt.NDArray[np.int64],
    terminators: npt.NDArray[np.int64],
    extension_counts: npt.NDArray[np.int64],
    chunk_symbols: int,
) -> bytes:
    ones = indices.size
    starts = np.arange(0, ones + 1, chunk_symbols, dtype=np.int64)
    previous = starts[1:] - 1
    positions = np.concatenate(([0], indices[previous] + 1))
    quotient_start = ones * scheme.width + int(extension_counts[-1])
    quotients = quotient_start + np.concatenate(([0], terminators[previous] + 1))
    columns = [positions, quotients]
    if scheme.code == "golomb":
        columns.append(ones * scheme.width + extension_counts[starts])
    return np.stack(columns, axis=1).astype("<u8").tobytes()


class _Encoded(NamedTuple):
    data: bytes
    scheme: _Scheme
    payload_bits: int


def _encode(
    indices: npt.NDArray[np.int64], length: int, code: str, parameter: int | None, chunk_symbols: int
) -> _Encoded:
    if isinstance(chunk_symbols, bool) or not isinstance(chunk_symbols, (int, np.integer)):
        raise TypeError(f"chunk_symbols must be an integer, got {type(chunk_symbols).__name__}")
    if not 1 <= chunk_symbols <= MAX_CHUNK_SYMBOLS:
        raise ValueError(f"chunk_symbols must be in [1, {MAX_CHUNK_SYMBOLS}], got {chunk_symbols}")
    runs, trailing = _runs(indices, length)
    scheme = _choose_scheme(code, parameter, runs, trailing, length)
    quotients, remainders = _split(scheme, runs)
    fields, extensions = _fields(scheme, remainders)
    ones = indices.size

    unary = np.append(quotients, trailing // scheme.modulus) + 1
    terminators = np.cumsum(unary) - 1
    plane_bits = ones * scheme.width
    quotient_start = plane_bits + extensions.size
    stream = np.zeros(quotient_start + int(terminators[-1]) + 1, dtype=bool)
    for plane in range(scheme.width):
        shift = scheme.width - 1 - plane
        stream[plane * ones : (plane + 1) * ones] = (fields >> shift) & 1
    stream[plane_bits:quotient_start] = extensions
    stream[quotient_start + terminators] = True

    if scheme.extended:
        long_codes = remainders >= scheme.cutoff
        extension_counts = np.concatenate(([0], np.cumsum(long_codes)))
    else:
        extension_counts = np.zeros(ones + 1, dtype=np.int64)
    header = HEADER.pack(MAGIC, VERSION, CODES.index(scheme.code), scheme.parameter, length, ones, chunk_symbols)
    table = _table(scheme, indices, terminators, extension_counts, chunk_symbols)
    return _Encoded(header + table + np.packbits(stream).tobytes(), scheme, stream.size)


def encode(
    bits: npt.ArrayLike,
    *,
    code: Code = "rice",
    parameter: int | None = None,
    chunk_symbols: int = DEFAULT_CHUNK_SYMBOLS,
) -> bytes:
    """Code a one-dimensional bool bitmap; ``parameter`` is Rice's ``k`` or Golomb's ``m`` (chosen if None)."""
    return _encode(*_set_bits(bits), code, parameter, chunk_symbols).data


def encode_indices(
    indices: npt.ArrayLike,
    length: int,
    *,
    code: Code = "rice",
    parameter: int | None = None,
    chunk_symbols: int = DEFAULT_CHUNK_SYMBOLS,
) -> bytes:
    """Code the bitmap of ``length`` positions whose set bits are ``indices`` (sorted, strictly increasing)."""
    return _encode(_as_indices(indices, length), int(length), code, parameter, chunk_symbols).data


def coded_size(
    bits: npt.ArrayLike,
    *,
    code: Code = "rice",
    parameter: int | None = None,
    chunk_symbols: int = DEFAULT_CHUNK_SYMBOLS,
) -> CodedSize:
    """Encode ``bits`` and report the footprint: raw bits, payload bits, container bytes and the entropy bound."""
    indices, length = _set_bits(bits)
    encoded = _encode(indices, length, code, parameter, chunk_symbols)
    return CodedSize(
        code=encoded.scheme.code,
        parameter=encoded.scheme.parameter,
        positions=length,
        ones=indices.size,
        raw_bits=length,
        payload_bits=encoded.payload_bits,
        container_bytes=len(encoded.data),
        entropy_bits=entropy_bits(length, indices.size),
    )


# --- decoding ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Container:
    scheme: _Scheme
    length: int
    ones: int
    chunk_symbols: int
    table: npt.NDArray[np.int64]
    payload: npt.NDArray[np.uint8]
    quotient_start: int

    @property
    def chunks(self) -> int:
        return len(self.table)


def _buffer(data: bytes | bytearray | memoryview) -> npt.NDArray[np.uint8]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"expected a bytes-like object, got {type(data).__name__}")
    return np.frombuffer(data, dtype=np.uint8)


def _parse(data: bytes | bytearray | memoryview, max_length: int | None = None) -> _Container:
    """Read and check the header and chunk table; nothing here allocates more than the input's size."""
    buffer = _buffer(data)
    if buffer.size < HEADER_SIZE:
        raise ValueError(f"truncated: {buffer.size} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, code_id, parameter, length, ones, chunk_symbols = HEADER.unpack_from(buffer)
    if magic != MAGIC:
        raise ValueError(f"not a Golomb-Rice bitmap: magic {magic!r}")
    if version != VERSION:
        raise ValueError(f"unsupported format version {version}")
    if code_id >= len(CODES):
        raise ValueError(f"unknown code id {code_id}")
    scheme = _scheme(CODES[code_id], parameter)
    limit = MAX_LENGTH if max_length is None else min(max_length, MAX_LENGTH)
    if length > limit:
        raise ValueError(f"bitmap length {length} exceeds the limit {limit}")
    if ones > length:
        raise ValueError(f"{ones} set bits in a bitmap of {length} positions")
    if chunk_symbols == 0:
        raise ValueError("chunk size of zero symbols")

    fields = ENTRY_FIELDS[scheme.code]
    chunks = -(-(ones + 1) // chunk_symbols)
    table_end = HEADER_SIZE + chunks * fields * 8
    if table_end > buffer.size:
        raise ValueError(f"truncated: chunk table of {chunks} entries runs past the end of the input")
    payload = buffer[table_end:]
    payload_bits = payload.size * 8
    plane_bits = ones * scheme.width
    if plane_bits + ones + 1 > payload_bits:
        raise ValueError("payload too short for the number of set bits the header states")
    if length - ones >= scheme.modulus * (payload_bits - plane_bits):
        raise ValueError("bitmap length is more than the payload can encode")

    raw = np.frombuffer(buffer, dtype="<u8", count=chunks * fields, offset=HEADER_SIZE).reshape(chunks, fields)
    table = _checked_table(raw, scheme, length, plane_bits, payload_bits)
    return _Container(scheme, length, ones, chunk_symbols, table, payload, int(table[0, 1]))


def _checked_table(
    raw: npt.NDArray[np.uint64], scheme: _Scheme, length: int, plane_bits: int, payload_bits: int
) -> npt.NDArray[np.int64]:
    positions, quotients = raw[:, 0], raw[:, 1]
    if positions[0] != 0 or (positions > length).any():
        raise ValueError("chunk table: bitmap positions out of range")
    if (quotients < plane_bits).any() or (quotients > payload_bits).any():
        raise ValueError("chunk table: quotient offsets out of range")
    if not scheme.extended and quotients[0] != plane_bits:
        raise ValueError("chunk table: quotients do not follow the remainders")
    if scheme.code == "golomb":
        extensions = raw[:, 2]
        if extensions[0] != plane_bits or (extensions > quotients[0]).any():
            raise ValueError("chunk table: extension offsets out of range")
    table = raw.astype(np.int64)
    if (np.diff(table, axis=0) < 0).any():
        raise ValueError("chunk table: offsets are not monotone")
    return table


def _bits(payload: npt.NDArray[np.uint8], start: int, stop: int) -> npt.NDArray[np.bool_]:
    """Payload bits ``start .. stop - 1`` as bools (a view into one unpacked copy of the bytes they span)."""
    first, last = start >> 3, (stop + 7) >> 3
    unpacked = np.unpackbits(payload[first:last]).view(bool)
    offset = start - first * 8
    return unpacked[offset : offset + stop - start]


@dataclass(frozen=True)
class _Lanes:
    """Unsigned lanes packed ``per_word`` to a uint64: one word operation does ``per_word`` lane operations, as
    long as no lane overflows into the next."""

    dtype: np.dtype
    bits: int
    per_word: int

    def word(self, lane_values: list[int]) -> np.uint64:
        return np.uint64(sum(value << (lane * self.bits) for lane, value in enumerate(lane_values)))


def _lanes_holding(largest: int) -> _Lanes:
    for dtype in ("<u1", "<u2", "<u4", "<u8"):
        bits = np.dtype(dtype).itemsize * 8
        if largest < 1 << bits:
            return _Lanes(np.dtype(dtype), bits, 64 // bits)
    raise AssertionError(f"{largest} does not fit in 64 bits")


def _remainder_lanes(modulus: int) -> _Lanes:
    return _lanes_holding(modulus - 1)


def _prefix_lanes(modulus: int) -> _Lanes:
    """Lanes in which a block of 8 remainders adds up without overflowing."""
    return _lanes_holding(8 * (modulus - 1))


def _padded(count: int) -> int:
    return -(-count // 8) * 8


def _plane_fields(container: _Container, first: int, count: int, lanes: _Lanes) -> npt.NDArray[np.unsignedinteger]:
    """The fixed-width fields of ``count`` symbols from ``first``, one per lane (zero-padded to whole words)."""
    scheme, ones = container.scheme, container.ones
    fields = np.zeros(_padded(count), dtype=lanes.dtype)
    plane = np.zeros_like(fields)
    field_words, plane_words = fields.view("<u8"), plane.view("<u8")
    for index in range(scheme.width):
        start = index * ones + first
        plane[:count] = _bits(container.payload, start, start + count)
        field_words <<= 1  # fields stay below 2**width, so no lane's top bit is ever set before a shift
        field_words |= plane_words
    return fields


_POPCOUNT = np.array([bin(byte).count("1") for byte in range(256)], dtype=np.uint8)


def _popcount(values: npt.NDArray[np.integer]) -> npt.NDArray[np.integer]:
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(values)
    return np.take(_POPCOUNT, values)  # numpy < 2.0


@functools.cache
def _deposit_table() -> npt.NDArray[np.uint64]:
    """For a byte ``mask`` of 8 symbols (first symbol in the top bit) and a byte ``window`` of extension bits,
    entry ``mask << 8 | window`` is 8 lanes holding, in each set lane, the next unused window bit, in order."""
    lanes = (np.arange(256)[:, None] >> (7 - np.arange(8))) & 1
    rank = np.cumsum(lanes, axis=1) - 1
    windows = np.arange(256)[None, :, None]
    deposited = lanes[:, None, :] * ((windows >> (7 - rank[:, None, :])) & 1)
    return deposited.astype(np.uint8).reshape(65536, 8).view(np.uint64).ravel()


def _extend(
    container: _Container,
    fields: npt.NDArray[np.unsignedinteger],
    count: int,
    extension_bits: tuple[int, int],
    boundaries: npt.NDArray[np.int64],
    lanes: _Lanes,
) -> npt.NDArray[np.int64]:
    """Golomb: turn fields into remainders in place (``2*x + bit - u`` where ``x >= u``); returns how many
    extension bits come before each boundary symbol."""
    cutoff = container.scheme.cutoff
    long_codes = fields >= cutoff
    long_codes[count:] = False
    masks = np.packbits(long_codes)
    counts = _popcount(masks).astype(np.int64)
    before = np.cumsum(counts)
    start, end = extension_bits
    total = int(before[-1]) if before.size else 0
    if total != end - start:
        raise ValueError("extension bits do not match the remainder fields")
    before -= counts

    windows = _windows(container.payload, start, end, before)
    deposited = np.take(_deposit_table(), masks.astype(windows.dtype) << 8 | windows).view(np.uint8)

    extensions = deposited if lanes.bits == 8 else deposited.astype(lanes.dtype)
    flags = long_codes.view(np.uint8) if lanes.bits == 8 else long_codes.astype(lanes.dtype)
    words, selected = fields.view("<u8"), flags.view("<u8")
    selected *= np.uint64((1 << lanes.bits) - 1)
    cutoffs = lanes.word([cutoff] * lanes.per_word) & selected
    selected &= words
    selected -= cutoffs  # no borrows: a long code's field is at least the cutoff
    words += selected
    words += extensions.view("<u8")

    return _count_before(masks, before, total, boundaries)


def _windows(payload: npt.NDArray[np.uint8], start: int, end: int, offsets: npt.NDArray[np.int64]) -> npt.NDArray:
    """The 8 payload bits from ``start + offset``, for each offset, as a byte (first bit on top), read from the
    big-endian pair of bytes that holds them; bits past ``end`` are read but never used."""
    first = start >> 3
    extension_bytes = np.concatenate((payload[first : (end + 7) >> 3], np.zeros(2, dtype=np.uint8)))
    index_type = np.int32 if end - start < 1 << 30 else np.int64
    pairs = extension_bytes[:-1].astype(index_type) << 8 | extension_bytes[1:]
    bit_offsets = (offsets + (start - 8 * first)).astype(index_type)
    return np.take(pairs, bit_offsets >> 3) << (bit_offsets & 7) >> 8 & 0xFF


def _count_before(
    masks: npt.NDArray[np.uint8], before: npt.NDArray[np.int64], total: int, symbols: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """How many flagged symbols precede each of ``symbols``, from the flag bytes and their running counts."""
    if not symbols.size:
        return symbols
    groups = symbols >> 3
    inside = groups < masks.size
    partial = np.take(masks, groups, mode="clip").astype(np.int64) >> (8 - (symbols & 7))
    return np.where(inside, np.take(before, groups, mode="clip") + _popcount(partial), total)


def _positions(
    terminators: npt.NDArray[np.int64],
    remainders: npt.NDArray[np.unsignedinteger],
    count: int,
    modulus: int,
    start: int,
) -> npt.NDArray[np.int64]:
    """Set-bit positions ``start + m*Q_i + R_i + i`` (``Q_i`` and ``R_i`` the quotients and remainders summed up
    to symbol ``i``), from the unary terminators ``T_i = Q_i + i``, computed over ``terminators``: that is
    ``m*T_i - (m-1)*i + R_i``.

    Symbols go in blocks of 8. ``R_i`` within a block is a prefix sum in the lanes (one multiplication by the
    all-ones word, plus the totals of the block's earlier words), biased per lane so that it absorbs the lane's
    share of ``-(m-1)*i``; one term per block does the rest. The arithmetic is modulo 2**64 (uint64); the
    caller's bounds make the true values exact."""
    lanes = _prefix_lanes(modulus)
    per_word, step = lanes.per_word, modulus - 1
    words_per_block = 8 // per_word
    all_lanes = lanes.word([1] * per_word)
    prefix = remainders.astype(lanes.dtype, copy=False).view("<u8") * all_lanes
    totals = prefix >> np.uint64(64 - lanes.bits)
    block_totals = np.zeros(prefix.size // words_per_block, dtype=np.uint64)
    for word in range(words_per_block):
        block_words = prefix[word::words_per_block]
        block_words += block_totals * all_lanes
        block_words += lanes.word([step * (7 - word * per_word - lane) for lane in range(per_word)])
        block_totals += totals[word::words_per_block]
    running = block_totals.astype(np.int64)
    adjust = (np.cumsum(running) - running).astype(np.uint64)
    adjust -= np.arange(adjust.size, dtype=np.uint64) * np.uint64(8 * step)
    adjust += np.uint64((start - 7 * step) % (1 << 64))

    inner = prefix.view(lanes.dtype)[:count]
    positions = terminators[:count].view(np.uint64)
    positions *= np.uint64(modulus)
    whole = count - count % 8
    rows = positions[:whole].reshape(-1, 8)
    rows += inner[:whole].reshape(-1, 8)
    rows += adjust[: whole // 8, None]
    if whole < count:
        positions[whole:] += inner[whole:]
        positions[whole:] += adjust[whole // 8]
    return positions.view(np.int64)


def _chunk_range(container: _Container, chunks: range | None) -> range:
    if chunks is None:
        return range(container.chunks)
    if not isinstance(chunks, range) or chunks.step != 1:
        raise TypeError("chunks must be a range with step 1")
    if not 0 <= chunks.start < chunks.stop <= container.chunks:
        raise ValueError(f"chunks {chunks} outside the {container.chunks} chunks of this bitmap")
    return chunks


@dataclass(frozen=True)
class _Span:
    """The symbols of a run of chunks and where their codes lie."""

    first: int
    symbols: int
    ones: int
    trailing: bool
    quotient_bits: tuple[int, int]
    extension_bits: tuple[int, int]
    position: int
    next_entry: npt.NDArray[np.int64] | None
    inner_entries: npt.NDArray[np.int64]
    boundaries: npt.NDArray[np.int64]


def _span(container: _Container, chunks: range) -> _Span:
    table, size = container.table, container.chunk_symbols
    first = chunks.start * size
    stop = min(chunks.stop * size, container.ones + 1)
    trailing = chunks.stop == container.chunks
    next_entry = None if trailing else table[chunks.stop]
    quotient_end = container.payload.size * 8 if trailing else int(next_entry[1])
    if container.scheme.extended:
        extension_end = container.quotient_start if trailing else int(next_entry[2])
        extension_bits = (int(table[chunks.start, 2]), extension_end)
    else:
        extension_bits = (0, 0)
    return _Span(
        first=first,
        symbols=stop - first,
        ones=min(stop, container.ones) - first,
        trailing=trailing,
        quotient_bits=(int(table[chunks.start, 1]), quotient_end),
        extension_bits=extension_bits,
        position=int(table[chunks.start, 0]),
        next_entry=next_entry,
        inner_entries=table[chunks.start + 1 : chunks.stop],
        boundaries=np.arange(1, len(chunks), dtype=np.int64) * size,
    )


def _terminators(container: _Container, span: _Span) -> npt.NDArray[np.int64]:
    unary = _bits(container.payload, *span.quotient_bits)
    terminators = np.flatnonzero(unary)
    if terminators.size != span.symbols:
        raise ValueError(f"expected {span.symbols} unary codes, found {terminators.size}")
    if span.trailing:
        if unary.size - terminators[-1] - 1 >= 8:
            raise ValueError("payload runs past the last code")
    elif terminators[-1] != unary.size - 1:
        raise ValueError("chunk table: quotient offset does not follow the previous chunk")
    if (span.inner_entries[:, 1] - span.quotient_bits[0] != terminators[span.boundaries - 1] + 1).any():
        raise ValueError("chunk table: quotient offsets do not match the codes")
    return terminators


def _decode_positions(container: _Container, chunks: range) -> npt.NDArray[np.int64]:
    """Set-bit positions of a run of chunks, checked against every table entry and header field they touch."""
    scheme, length = container.scheme, container.length
    span = _span(container, chunks)
    terminators = _terminators(container, span)
    if scheme.modulus * (int(terminators[-1]) + 1 - span.symbols) > length:
        raise ValueError("quotients add up to more than the bitmap length")
    last_quotient = int(terminators[-1] - (terminators[-2] if span.symbols > 1 else -1)) - 1

    lanes = _remainder_lanes(scheme.modulus)
    remainders = _plane_fields(container, span.first, span.ones, lanes)
    if scheme.extended:
        before = _extend(container, remainders, span.ones, span.extension_bits, span.boundaries, lanes)
        if (span.inner_entries[:, 2] - span.extension_bits[0] != before).any():
            raise ValueError("chunk table: extension offsets do not match the codes")
    if span.ones * scheme.modulus >= 1 << 62 and remainders.sum(dtype=np.float64) > length:
        raise ValueError("remainders add up to more than the bitmap length")

    positions = _positions(terminators, remainders, span.ones, scheme.modulus, span.position)
    end = int(positions[-1]) + 1 if span.ones else span.position
    if end > length:
        raise ValueError("runs add up to more than the bitmap length")
    if (span.inner_entries[:, 0] != positions[span.boundaries - 1] + 1).any():
        raise ValueError("chunk table: bitmap positions do not match the codes")
    if span.trailing and (length - end) // scheme.modulus != last_quotient:
        raise ValueError("bitmap length does not match the trailing run")
    if not span.trailing and end != int(span.next_entry[0]):
        raise ValueError("chunk table: bitmap position does not follow the previous chunk")
    return positions


def decode_indices(data: bytes | bytearray | memoryview, *, chunks: range | None = None) -> npt.NDArray[np.int64]:
    """The set-bit positions of a coded bitmap (of only the chunks in ``chunks``, if given), as int64."""
    container = _parse(data)
    return _decode_positions(container, _chunk_range(container, chunks))


def bitmap_counts(data: bytes | bytearray | memoryview) -> tuple[int, int]:
    """``(positions, set bits)`` a coded bitmap declares, after the header and chunk table are checked."""
    container = _parse(data)
    return container.length, container.ones


def chunk_count(data: bytes | bytearray | memoryview) -> int:
    """How many independently decodable chunks a coded bitmap has."""
    return _parse(data).chunks


def decode(data: bytes | bytearray | memoryview, *, max_length: int | None = None) -> npt.NDArray[np.bool_]:
    """The bool bitmap of a coded buffer; ``max_length`` refuses bitmaps longer than the caller can hold."""
    container = _parse(data, max_length)
    positions = _decode_positions(container, range(container.chunks))
    return _bitmap(positions, container.length)


_OUTPUT_BLOCK = 1 << 19


def _bitmap(positions: npt.NDArray[np.int64], length: int) -> npt.NDArray[np.bool_]:
    """Zero and fill the bitmap a cache-sized block at a time: one pass, with the scattered writes hitting cache."""
    try:
        bitmap = np.empty(length, dtype=bool)
    except MemoryError as error:
        raise ValueError(f"a bitmap of {length} positions does not fit in memory") from error
    starts = np.arange(0, length, _OUTPUT_BLOCK)
    cuts = np.searchsorted(positions, np.append(starts, length))
    for block, start in enumerate(starts.tolist()):
        bitmap[start : start + _OUTPUT_BLOCK] = False
        bitmap[positions[cuts[block] : cuts[block + 1]]] = True
    return bitmap
