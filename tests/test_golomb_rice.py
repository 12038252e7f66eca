"""Golomb-Rice bitmap codec: round trips, the documented layout, the entropy bound and hostile input."""

from __future__ import annotations

import math
import struct
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moecompress.kernels import golomb_rice as gr

# The layout as the module docstring documents it, written out here rather than read from the module.
HEADER_FORMAT = "<4sBBQQQI"
HEADER_BYTES = 34
ENTRY_BYTES = {"rice": 16, "golomb": 24}
CODE_IDS = {"rice": 0, "golomb": 1}
LIMIT = 1 << 22  # max_length for decoding fuzzed input

codes = pytest.mark.parametrize("code", ["rice", "golomb"])


def header(data: bytes) -> dict:
    magic, version, code, parameter, length, ones, chunk = struct.unpack_from(HEADER_FORMAT, data)
    return {
        "magic": magic,
        "version": version,
        "code": code,
        "parameter": parameter,
        "n": length,
        "c": ones,
        "N": chunk,
    }


def with_header(data: bytes, **fields) -> bytes:
    values = header(data) | fields
    packed = struct.pack(HEADER_FORMAT, *values.values())
    return packed + data[HEADER_BYTES:]


def overhead_bytes(code: str, ones: int, chunk_symbols: int) -> int:
    return HEADER_BYTES + -(-(ones + 1) // chunk_symbols) * ENTRY_BYTES[code]


def assert_round_trip(bits: np.ndarray, **options) -> bytes:
    data = gr.encode(bits, **options)
    decoded = gr.decode(data)
    assert decoded.dtype == np.bool_ and decoded.shape == bits.shape
    np.testing.assert_array_equal(decoded, bits)
    np.testing.assert_array_equal(gr.decode_indices(data), np.flatnonzero(bits))
    assert gr.decode_indices(data).dtype == np.int64
    return data


def assert_decodes_or_rejects(data: bytes) -> None:
    """A buffer either raises ValueError from both decoders or is exactly the encoding of what it decodes to
    (the format is canonical), and the decoders agree."""
    try:
        indices = gr.decode_indices(data)
    except ValueError:
        with pytest.raises(ValueError):
            gr.decode(data, max_length=LIMIT)
        return
    fields = header(data)
    options = {"code": gr.CODES[fields["code"]], "parameter": fields["parameter"], "chunk_symbols": fields["N"]}
    assert gr.encode_indices(indices, fields["n"], **options) == data
    if fields["n"] > LIMIT:
        with pytest.raises(ValueError):
            gr.decode(data, max_length=LIMIT)
    else:
        np.testing.assert_array_equal(np.flatnonzero(gr.decode(data, max_length=LIMIT)), indices)


# --- round trips ---------------------------------------------------------------------------------------------


@codes
@pytest.mark.parametrize(
    "bits",
    [
        [],
        [False],
        [True],
        [False] * 1000,
        [True] * 1000,
        [True] + [False] * 99,
        [False] * 99 + [True],
        [True] + [False] * 98 + [True],
    ],
    ids=["empty", "zero", "one", "zeros", "ones", "first", "last", "ends"],
)
def test_round_trip_edge_cases(code: str, bits: list[bool]) -> None:
    assert_round_trip(np.array(bits, dtype=bool), code=code)


@codes
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1, 0.3, 0.5, 0.9])
def test_round_trip_random(code: str, density: float) -> None:
    bits = np.random.default_rng(7).random(50_000) < density
    assert_round_trip(bits, code=code)


@codes
def test_round_trip_across_output_blocks(code: str) -> None:
    """Bitmaps longer than the blocks the decoder fills its output in, with ones on either side of the edges."""
    bits = np.random.default_rng(8).random(3 << 20) < 0.001
    for edge in (1 << 18, 1 << 19, 1 << 20, 1 << 21):
        bits[edge - 1 : edge + 1] = True
    bits[-1] = True
    assert_round_trip(bits, code=code)
    assert_round_trip(bits[: (1 << 20) + 1], code=code)


@codes
@pytest.mark.parametrize("ones", [0, 6, 7, 8, 9, 15, 16, 17, 23, 24, 25])
def test_chunk_boundaries(code: str, ones: int) -> None:
    """``c + 1`` symbols around multiples of the chunk size; every chunk, and every run of chunks, decodes alone."""
    rng = np.random.default_rng(ones)
    bits = np.zeros(400, dtype=bool)
    bits[np.sort(rng.choice(400, ones, replace=False))] = True
    data = assert_round_trip(bits, code=code, chunk_symbols=8)
    chunks = gr.chunk_count(data)
    assert chunks == -(-(ones + 1) // 8)
    payload_bits = gr.coded_size(bits, code=code, chunk_symbols=8).payload_bits
    assert len(data) == overhead_bytes(code, ones, 8) + -(-payload_bits // 8)
    expected = np.flatnonzero(bits)
    for first in range(chunks):
        for stop in range(first + 1, chunks + 1):
            part = gr.decode_indices(data, chunks=range(first, stop))
            np.testing.assert_array_equal(part, expected[first * 8 : stop * 8])


@pytest.mark.parametrize(
    ("code", "parameter"),
    [("rice", k) for k in (0, 1, 2, 3, 5, 6, 8, 9, 13, 16, 17, 33, 40)]
    + [("golomb", m) for m in (1, 2, 3, 4, 5, 7, 8, 31, 32, 33, 256, 257, 1000, 8193, 65537, 1 << 40)],
)
def test_explicit_parameters(code: str, parameter: int) -> None:
    bits = np.random.default_rng(parameter).random(3000) < 0.05
    data = assert_round_trip(bits, code=code, parameter=parameter, chunk_symbols=37)
    assert header(data)["parameter"] == parameter
    assert header(data)["code"] == CODE_IDS[code]


@codes
def test_index_variant(code: str) -> None:
    rng = np.random.default_rng(3)
    indices = np.sort(rng.choice(10_000, 321, replace=False))
    data = gr.encode_indices(indices, 10_000, code=code, chunk_symbols=50)
    bits = np.zeros(10_000, dtype=bool)
    bits[indices] = True
    assert data == gr.encode(bits, code=code, chunk_symbols=50)
    np.testing.assert_array_equal(gr.decode_indices(data), indices)
    np.testing.assert_array_equal(gr.decode_indices(gr.encode_indices([], 0, code=code)), [])
    np.testing.assert_array_equal(gr.decode(gr.encode_indices(np.array([4], dtype=np.uint8), 5)), [0, 0, 0, 0, 1])


@pytest.mark.parametrize(
    ("indices", "length", "error"),
    [
        ([3, 2], 10, ValueError),
        ([2, 2], 10, ValueError),
        ([-1, 2], 10, ValueError),
        ([2, 10], 10, ValueError),
        ([[1, 2]], 10, ValueError),
        ([1.0, 2.0], 10, TypeError),
        ([True], 10, TypeError),
        ([1], -1, ValueError),
        ([1], gr.MAX_LENGTH + 1, ValueError),
        ([1], 2.5, TypeError),
        (np.array([5, 2**64 - 1, 7], dtype=np.uint64), 10, ValueError),
    ],
)
def test_index_validation(indices, length, error) -> None:
    with pytest.raises(error):
        gr.encode_indices(indices, length)


def test_encode_validation() -> None:
    assert gr.decode(gr.encode([True, False])).tolist() == [True, False]
    assert gr.decode(gr.encode([])).size == 0
    with pytest.raises(ValueError):
        gr.encode(np.zeros((2, 2), dtype=bool))
    with pytest.raises(ValueError):
        gr.encode(np.bool_(True))
    with pytest.raises(TypeError):
        gr.encode(np.array([0, 1]))
    with pytest.raises(ValueError):
        gr.encode([True], code="huffman")
    with pytest.raises(ValueError):
        gr.encode([True], code="rice", parameter=gr.MAX_RICE_K + 1)
    with pytest.raises(ValueError):
        gr.encode([True], code="golomb", parameter=0)
    with pytest.raises(TypeError):
        gr.encode([True], parameter=2.0)
    with pytest.raises(ValueError):
        gr.encode([True], chunk_symbols=0)
    with pytest.raises(TypeError):
        gr.decode("not bytes")


@codes
def test_bytes_like_inputs(code: str) -> None:
    bits = np.random.default_rng(1).random(999) < 0.2
    data = gr.encode(bits, code=code)
    for view in (bytearray(data), memoryview(data)):
        np.testing.assert_array_equal(gr.decode(view), bits)


# --- property tests ------------------------------------------------------------------------------------------


@st.composite
def sparse_bitmaps(draw) -> np.ndarray:
    length = draw(st.integers(0, 3000))
    ones = draw(st.sets(st.integers(0, max(length - 1, 0)), max_size=min(length, 200))) if length else set()
    bits = np.zeros(length, dtype=bool)
    bits[sorted(ones)] = True
    return bits


@st.composite
def coding_options(draw) -> dict:
    code = draw(st.sampled_from(gr.CODES))
    parameters = st.integers(0, 12) if code == "rice" else st.integers(1, 600)
    return {
        "code": code,
        "parameter": draw(st.none() | parameters),
        "chunk_symbols": draw(st.sampled_from([1, 2, 7, 8, 64, gr.DEFAULT_CHUNK_SYMBOLS])),
    }


@settings(max_examples=150, deadline=None)
@given(
    bits=st.lists(st.booleans(), max_size=500).map(lambda bits: np.array(bits, dtype=bool)), options=coding_options()
)
def test_property_round_trip_dense(bits: np.ndarray, options: dict) -> None:
    assert_round_trip(bits, **options)


@settings(max_examples=150, deadline=None)
@given(bits=sparse_bitmaps(), options=coding_options())
def test_property_round_trip_sparse(bits: np.ndarray, options: dict) -> None:
    data = assert_round_trip(bits, **options)
    assert data == gr.encode_indices(np.flatnonzero(bits), bits.size, **options)


@settings(max_examples=150, deadline=None)
@given(
    length=st.integers(1, 1 << 40),
    offsets=st.lists(st.integers(0, (1 << 40) - 1), max_size=50),
    options=coding_options(),
)
def test_property_index_lists(length: int, offsets: list[int], options: dict) -> None:
    """Index lists over lengths up to the format's limit, which only ``decode_indices`` can afford."""
    indices = np.array(sorted({offset % length for offset in offsets}), dtype=np.int64)
    if options["parameter"] is not None and options["code"] == "rice":
        options["parameter"] += 28  # small moduli would take gigabytes of unary code for runs of 2**40
    elif options["parameter"] is not None:
        options["parameter"] <<= 30
    data = gr.encode_indices(indices, length, **options)
    np.testing.assert_array_equal(gr.decode_indices(data), indices)
    assert header(data)["n"] == length


# --- the documented layout -----------------------------------------------------------------------------------


def test_layout_rice_by_hand() -> None:
    # bits 00101: runs 2 and 1, trailing run 0; k = 1 gives quotients 1, 0 (+0 trailing), remainders 0, 1.
    data = gr.encode([False, False, True, False, True], code="rice", parameter=1)
    table = struct.pack("<QQ", 0, 2)
    # one remainder plane "01", then unary "01" "1" "1", padded: 01 0111 00
    assert data == struct.pack(HEADER_FORMAT, b"MCGR", 1, 0, 1, 5, 2, gr.DEFAULT_CHUNK_SYMBOLS) + table + b"\x5c"


def test_layout_golomb_by_hand() -> None:
    # m = 3: b = 2, u = 1. Remainders 2 and 1 both take 2 bits: fields (r+u)>>1 = 1, 1 and extension bits 1, 0.
    data = gr.encode([False, False, True, False, True], code="golomb", parameter=3)
    table = struct.pack("<QQQ", 0, 4, 2)
    # plane "11", extensions "10", unary "1" "1" "1", padded: 11 10 111 0
    assert data == struct.pack(HEADER_FORMAT, b"MCGR", 1, 1, 3, 5, 2, gr.DEFAULT_CHUNK_SYMBOLS) + table + b"\xee"


@codes
def test_header_and_table(code: str) -> None:
    bits = np.random.default_rng(5).random(5000) < 0.03
    indices = np.flatnonzero(bits)
    data = gr.encode(bits, code=code, chunk_symbols=20)
    fields = header(data)
    assert fields["magic"] == b"MCGR" and fields["version"] == 1 and fields["code"] == CODE_IDS[code]
    assert (fields["n"], fields["c"], fields["N"]) == (5000, indices.size, 20)
    chunks = -(-(indices.size + 1) // 20)
    columns = ENTRY_BYTES[code] // 8
    table = np.frombuffer(data, "<u8", chunks * columns, HEADER_BYTES).reshape(chunks, columns)
    starts = np.arange(chunks) * 20
    np.testing.assert_array_equal(table[1:, 0], indices[starts[1:] - 1] + 1)
    assert table[0, 0] == 0
    assert (np.diff(table[:, 1]) >= 20).all()


@codes
def test_coded_size(code: str) -> None:
    bits = np.random.default_rng(2).random(100_000) < 0.02
    size = gr.coded_size(bits, code=code)
    data = gr.encode(bits, code=code)
    assert size.container_bytes == len(data)
    assert size.raw_bits == size.positions == bits.size and size.ones == bits.sum()
    assert size.overhead_bytes == overhead_bytes(code, size.ones, gr.DEFAULT_CHUNK_SYMBOLS)
    assert math.isclose(size.entropy_bits, gr.entropy_bits(bits.size, size.ones))
    assert 1 < size.ratio_to_entropy < 1.035
    assert size.parameter == header(data)["parameter"]


# --- the entropy bound ---------------------------------------------------------------------------------------


BOUND = {"rice": 1.035, "golomb": 1.015}


def binary_entropy(p: float) -> float:
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


@codes
@pytest.mark.parametrize("density", [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25])
def test_size_within_entropy_bound(code: str, density: float) -> None:
    """Payload bits (the container less its header and chunk table) against ``n·H(p̂)``, ``p̂`` each bitmap's own
    density, over several seeds."""
    for seed in range(4):
        bits = np.random.default_rng(seed).random(300_000) < density
        ones = int(bits.sum())
        data = gr.encode(bits, code=code)
        payload_bits = 8 * (len(data) - overhead_bytes(code, ones, gr.DEFAULT_CHUNK_SYMBOLS))
        bound = bits.size * binary_entropy(ones / bits.size)
        assert payload_bits <= BOUND[code] * bound, (seed, payload_bits / bound)


# --- hostile input -------------------------------------------------------------------------------------------


def small_encoding(code: str) -> bytes:
    bits = np.random.default_rng(11).random(300) < 0.1
    return gr.encode(bits, code=code, chunk_symbols=4)


@codes
def test_every_truncation_rejected(code: str) -> None:
    data = small_encoding(code)
    for size in range(len(data)):
        with pytest.raises(ValueError):
            gr.decode(data[:size])
        with pytest.raises(ValueError):
            gr.decode_indices(data[:size])
    for extra in (b"\x00", b"\x80", b"\xff" * 9):
        with pytest.raises(ValueError):
            gr.decode(data + extra)


@codes
def test_random_mutations(code: str) -> None:
    rng = np.random.default_rng(12)
    data = small_encoding(code)
    for _ in range(1500):
        mutated = bytearray(data)
        for _ in range(rng.integers(1, 4)):
            where = int(rng.integers(len(mutated)))
            if rng.random() < 0.5:
                mutated[where] ^= 1 << int(rng.integers(8))
            else:
                mutated[where] = int(rng.integers(256))
        assert_decodes_or_rejects(bytes(mutated))


def test_random_garbage() -> None:
    rng = np.random.default_rng(13)
    prefixes = [b"", b"MCGR", b"MCGR\x01\x00", b"MCGR\x01\x01"]
    for _ in range(3000):
        prefix = prefixes[int(rng.integers(len(prefixes)))]
        garbage = prefix + rng.integers(0, 256, int(rng.integers(0, 120)), dtype=np.uint8).tobytes()
        assert_decodes_or_rejects(garbage)


def assert_rejected_quickly(data: bytes) -> None:
    tracemalloc.start()
    start = time.perf_counter()
    for decoder in (gr.decode, gr.decode_indices):
        with pytest.raises(ValueError):
            decoder(data)
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 0.5 and peak < 1 << 20, (elapsed, peak)


def hostile_fields(data: bytes) -> list[dict]:
    """Header fields that no valid encoding of this content can have."""
    fields = header(data)
    last_one = int(gr.decode_indices(data)[-1])
    other_code = {"parameter": 1 << 41} if fields["code"] else {"parameter": 41}
    return [
        {"magic": b"MCGX"},
        {"magic": b"\x00" * 4},
        {"version": 0},
        {"version": 2},
        {"code": 2},
        {"code": 255},
        {"n": 1 << 40},
        {"n": (1 << 40) + 1},
        {"n": (1 << 64) - 1},
        {"n": last_one},
        {"n": 0},
        {"c": (1 << 64) - 1},
        {"c": 1 << 39},
        {"c": fields["c"] + 1},
        {"c": fields["c"] - 1},
        {"c": 0},
        {"N": 0},
        {"N": 1},
        {"N": fields["N"] + 1},
        {"parameter": (1 << 64) - 1},
        other_code,
    ]


@codes
def test_hostile_headers(code: str) -> None:
    data = small_encoding(code)
    for fields in hostile_fields(data):
        assert_rejected_quickly(with_header(data, **fields))


@codes
def test_header_field_sweep(code: str) -> None:
    """Any value in any header field: a valid encoding of something, or ValueError."""
    data = small_encoding(code)
    rng = np.random.default_rng(14)
    for name in ("version", "code", "parameter", "n", "c", "N"):
        for value in list(range(0, 70)) + [int(v) for v in rng.integers(0, 1 << 40, 30)]:
            if name in ("version", "code") and value > 255:
                continue
            assert_decodes_or_rejects(with_header(data, **{name: value % (1 << 32) if name == "N" else value}))


@codes
def test_hostile_tables(code: str) -> None:
    data = small_encoding(code)
    fields = header(data)
    columns = ENTRY_BYTES[code] // 8
    chunks = -(-(fields["c"] + 1) // fields["N"])
    payload_bits = 8 * (len(data) - HEADER_BYTES - chunks * ENTRY_BYTES[code])
    for row in range(chunks):
        for column in range(columns):
            for value in (0, 1, fields["n"], fields["n"] + 1, payload_bits, payload_bits + 1, (1 << 64) - 1):
                table = np.frombuffer(data, "<u8", chunks * columns, HEADER_BYTES).copy()
                if table[row * columns + column] == value:
                    continue
                table[row * columns + column] = value
                mutated = data[:HEADER_BYTES] + table.tobytes() + data[HEADER_BYTES + table.nbytes :]
                with pytest.raises(ValueError):
                    gr.decode(mutated)
                with pytest.raises(ValueError):
                    gr.decode_indices(mutated, chunks=range(max(row - 1, 0), min(row + 1, chunks)))


@codes
def test_huge_length_needs_a_payload(code: str) -> None:
    """n is bounded by the payload: each unary bit stands for at most m positions."""
    data = gr.encode_indices([], 1000, code=code, parameter=4 if code == "golomb" else 2)  # m = 4: quotient 250
    assert_rejected_quickly(with_header(data, n=1 << 40))
    assert_rejected_quickly(with_header(data, n=999))
    assert_rejected_quickly(with_header(data, n=1004))
    assert gr.decode(with_header(data, n=1003)).size == 1003  # the same trailing quotient: a valid encoding


def test_genuine_huge_bitmap() -> None:
    """An all-zero bitmap of 2**40 positions is a few bytes; max_length refuses it before anything is allocated."""
    data = gr.encode_indices([], 1 << 40, code="golomb")
    assert len(data) < 64
    np.testing.assert_array_equal(gr.decode_indices(data), [])
    assert_rejected_quickly_with_limit(data)
    data = gr.encode_indices([0, (1 << 40) - 1], 1 << 40, code="rice")
    np.testing.assert_array_equal(gr.decode_indices(data), [0, (1 << 40) - 1])
    assert_rejected_quickly_with_limit(data)


def assert_rejected_quickly_with_limit(data: bytes) -> None:
    tracemalloc.start()
    with pytest.raises(ValueError):
        gr.decode(data, max_length=1 << 30)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20
