"""Fuzz the Golomb-Rice bitmap decoder with mutated valid encodings and random bytes.

Every input must either raise ValueError (from ``decode``, ``decode_indices`` and a chunk-range decode alike)
or decode to a bitmap whose encoding, with the header's code, parameter and chunk size, is exactly the input
(the format is canonical); the two decoders must agree, a chunk range must give its slice of the whole, and no
input may take longer than a second. Mutations: bit flips, byte overwrites, truncation, extension, inserted and
deleted bytes, header fields and chunk-table entries set to edge or random values, and splices of two
encodings. Prints one JSON object (inputs tried, decoded, rejected, failures with the input in hex); exits 1
on any failure.

Run: python scripts/fuzz_golomb_rice.py [--seconds 60] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import struct
import time
import traceback

import numpy as np

from moecompress.kernels import golomb_rice

LIMIT = 1 << 22
SLOW_SECONDS = 1.0
EDGE_VALUES = (0, 1, 2, 7, 8, 255, 256, (1 << 31) - 1, 1 << 32, 1 << 40, (1 << 40) + 1, (1 << 63), (1 << 64) - 1)
HEADER_FIELDS = {"parameter": (6, 8), "length": (14, 8), "ones": (22, 8), "chunk": (30, 4), "code": (5, 1)}


def corpus(rng: np.random.Generator, count: int) -> list[bytes]:
    """Valid encodings of random bitmaps: sizes, densities, codes, parameters and chunk sizes varied."""
    encodings = []
    for _ in range(count):
        length = int(rng.choice([0, 1, 2, 9, 64, 300, 2000, 20000]))
        density = float(rng.choice([0.0, 0.001, 0.01, 0.1, 0.3, 0.7, 1.0]))
        bits = rng.random(length) < density
        code = str(rng.choice(golomb_rice.CODES))
        parameter = None
        if rng.random() < 0.3:
            parameter = int(rng.integers(0, 12)) if code == "rice" else int(rng.integers(1, 300))
        chunk = int(rng.choice([1, 3, 8, 64, golomb_rice.DEFAULT_CHUNK_SYMBOLS]))
        encodings.append(golomb_rice.encode(bits, code=code, parameter=parameter, chunk_symbols=chunk))
    return encodings


def set_field(data: bytearray, offset: int, size: int, value: int) -> None:
    if len(data) >= offset + size:
        data[offset : offset + size] = (value % (1 << (8 * size))).to_bytes(size, "little")


def mutate(rng: np.random.Generator, data: bytes, other: bytes) -> bytes:
    mutated = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        kind = int(rng.integers(9))
        where = int(rng.integers(len(mutated) + 1))
        if kind == 0 and mutated:
            mutated[min(where, len(mutated) - 1)] ^= 1 << int(rng.integers(8))
        elif kind == 1 and mutated:
            mutated[min(where, len(mutated) - 1)] = int(rng.integers(256))
        elif kind == 2:
            del mutated[where:]
        elif kind == 3:
            mutated += rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes()
        elif kind == 4:
            mutated[where:where] = rng.integers(0, 256, int(rng.integers(1, 8)), dtype=np.uint8).tobytes()
        elif kind == 5:
            del mutated[where : where + int(rng.integers(1, 8))]
        elif kind == 6:
            offset, size = list(HEADER_FIELDS.values())[int(rng.integers(len(HEADER_FIELDS)))]
            set_field(mutated, offset, size, edge_or_random(rng))
        elif kind == 7:
            entry = golomb_rice.HEADER_SIZE + 8 * int(rng.integers(0, 12))
            set_field(mutated, entry, 8, edge_or_random(rng))
        else:
            cut = int(rng.integers(len(other) + 1))
            mutated = mutated[:where] + other[cut:]
    return bytes(mutated)


def edge_or_random(rng: np.random.Generator) -> int:
    if rng.random() < 0.5:
        return int(rng.choice(EDGE_VALUES)) + int(rng.integers(-1, 2))
    return int(rng.integers(0, 1 << 62)) >> int(rng.integers(0, 62))


def random_bytes(rng: np.random.Generator) -> bytes:
    body = rng.integers(0, 256, int(rng.integers(0, 200)), dtype=np.uint8).tobytes()
    if rng.random() < 0.5:
        return body
    prefix = golomb_rice.MAGIC + struct.pack("<BB", golomb_rice.VERSION, int(rng.integers(2)))
    return prefix + body


def check(data: bytes, rng: np.random.Generator) -> bool:
    """True if ``data`` decoded, False if rejected; raises AssertionError on anything else."""
    try:
        indices = golomb_rice.decode_indices(data)
    except ValueError:
        expect_rejection(lambda: golomb_rice.decode(data, max_length=LIMIT))
        check_chunks(data, None, rng)
        return False
    _, _, code, parameter, length, _, chunk = golomb_rice.HEADER.unpack_from(data)
    options = {"code": golomb_rice.CODES[code], "parameter": parameter, "chunk_symbols": chunk}
    if golomb_rice.encode_indices(indices, length, **options) != data:
        raise AssertionError("decoded, but the input is not the encoding of what it decoded to")
    if length > LIMIT:
        expect_rejection(lambda: golomb_rice.decode(data, max_length=LIMIT))
    elif not np.array_equal(np.flatnonzero(golomb_rice.decode(data, max_length=LIMIT)), indices):
        raise AssertionError("decode and decode_indices disagree")
    check_chunks(data, indices, rng)
    return True


def check_chunks(data: bytes, indices: np.ndarray | None, rng: np.random.Generator) -> None:
    try:
        chunks = golomb_rice.chunk_count(data)
    except ValueError:
        return
    first = int(rng.integers(chunks))
    span = range(first, int(rng.integers(first + 1, chunks + 1)))
    try:
        part = golomb_rice.decode_indices(data, chunks=span)
    except ValueError:
        if indices is not None:
            raise AssertionError("a valid encoding's chunk range was rejected") from None
        return
    if indices is not None:
        size = golomb_rice.HEADER.unpack_from(data)[-1]
        if not np.array_equal(part, indices[span.start * size : span.stop * size]):
            raise AssertionError("a chunk range decoded to something other than its slice")


def expect_rejection(work) -> None:
    try:
        work()
    except ValueError:
        return
    raise AssertionError("one decoder rejected the input and another accepted it")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    encodings = corpus(rng, 200)
    counts = {"tried": 0, "decoded": 0, "rejected": 0, "valid_corpus": len(encodings)}
    failures = []
    slowest = 0.0
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        if rng.random() < 0.85:
            pair = rng.integers(len(encodings), size=2)
            data = mutate(rng, encodings[pair[0]], encodings[pair[1]])
        else:
            data = random_bytes(rng)
        start = time.perf_counter()
        try:
            decoded = check(data, rng)
        except Exception as error:  # everything but ValueError from the decoders is a finding
            failures.append({"input": data.hex(), "error": repr(error), "traceback": traceback.format_exc()})
            decoded = None
        elapsed = time.perf_counter() - start
        slowest = max(slowest, elapsed)
        if elapsed > SLOW_SECONDS:
            failures.append({"input": data.hex(), "error": f"took {elapsed:.2f} s"})
        counts["tried"] += 1
        if decoded is not None:
            counts["decoded" if decoded else "rejected"] += 1
    report = {**counts, "seconds": args.seconds, "seed": args.seed, "slowest_input_seconds": slowest}
    print(json.dumps({**report, "failures": failures[:20], "failure_count": len(failures)}, indent=1))
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
