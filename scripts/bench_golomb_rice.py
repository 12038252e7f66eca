"""Golomb-Rice bitmap coding against zlib and zstd: sizes and decode speeds on random bitmaps.

Each bitmap has ``n`` positions set independently with probability ``p``. Sizes: the entropy bound
``n·H(p̂)/8`` (``p̂`` the bitmap's own density), our whole containers (header and chunk table included) and
zlib level 9 / zstd level 19 on the packed bitmap (``np.packbits``). Decode speeds are bitmap positions per
second, the best of several interleaved repetitions, single-threaded:

- ``rice``, ``golomb``: our bytes to a numpy bool array (``decode``);
- ``rice idx``, ``golomb idx``: our bytes to the int64 positions of the set bits (``decode_indices``);
- ``zlib``, ``zstd``: decompressing to the packed bytes only (8 positions per byte);
- ``zlib+unpack``, ``zstd+unpack``: the same followed by ``np.unpackbits`` to a bool array, the output ours gives.

Prints a markdown table, then one JSON object.

Run: python scripts/bench_golomb_rice.py [--log2-n 24] [--densities 0.001,0.005,...] [--repeats 7] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import zlib
from collections.abc import Callable

import numpy as np
import zstandard

from moecompress.kernels import golomb_rice

DENSITIES = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25)


def best_seconds(timed: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time of each callable; repetitions are interleaved so that background load hits all alike."""
    best = dict.fromkeys(timed, float("inf"))
    for _ in range(repeats):
        for name, work in timed.items():
            start = time.perf_counter()
            work()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def measure(bits: np.ndarray, repeats: int) -> dict:
    n = bits.size
    packed = np.packbits(bits).tobytes()
    ours = {code: golomb_rice.encode(bits, code=code) for code in golomb_rice.CODES}
    for code, data in ours.items():
        if not np.array_equal(golomb_rice.decode(data), bits):
            raise AssertionError(f"{code} round trip failed")
    deflated = zlib.compress(packed, 9)
    zstd_data = zstandard.ZstdCompressor(level=19).compress(packed)
    unzstd = zstandard.ZstdDecompressor()
    if zlib.decompress(deflated) != packed or unzstd.decompress(zstd_data) != packed:
        raise AssertionError("zlib or zstd round trip failed")

    def unpacked(raw: bytes) -> np.ndarray:
        return np.unpackbits(np.frombuffer(raw, dtype=np.uint8)).view(bool)

    timed = {
        "rice": lambda: golomb_rice.decode(ours["rice"]),
        "golomb": lambda: golomb_rice.decode(ours["golomb"]),
        "rice idx": lambda: golomb_rice.decode_indices(ours["rice"]),
        "golomb idx": lambda: golomb_rice.decode_indices(ours["golomb"]),
        "zlib": lambda: zlib.decompress(deflated),
        "zlib+unpack": lambda: unpacked(zlib.decompress(deflated)),
        "zstd": lambda: unzstd.decompress(zstd_data),
        "zstd+unpack": lambda: unpacked(unzstd.decompress(zstd_data)),
    }
    ones = int(np.count_nonzero(bits))
    bound = golomb_rice.entropy_bits(n, ones) / 8
    sizes = {"rice": len(ours["rice"]), "golomb": len(ours["golomb"]), "zlib": len(deflated), "zstd": len(zstd_data)}
    speeds = {name: n / seconds for name, seconds in best_seconds(timed, repeats).items()}
    return {
        "density": ones / n,
        "ones": ones,
        "entropy_bytes": bound,
        "bytes": sizes,
        "ratio_to_entropy": {name: size / bound for name, size in sizes.items()},
        "positions_per_second": speeds,
    }


LEGEND = (
    "Sizes in bytes (ours: the whole container, header and chunk table included) and as a ratio to the entropy "
    "bound n·H(p̂)/8. Decode speeds in 10^9 bitmap positions per second, best of the repetitions, one thread: "
    "rice/golomb = our bytes to a bool array; idx = our bytes to int64 set-bit positions; zlib/zstd = "
    "decompressing to the packed bitmap (np.packbits, 8 positions a byte); +unpack = then np.unpackbits to a bool "
    "array."
)


def markdown(rows: list[dict]) -> str:
    speeds = list(rows[0]["positions_per_second"])
    head = "| p | H bound | rice | golomb | zlib-9 | zstd-19 | rice/H | golomb/H | zlib/H | zstd/H | "
    head += " | ".join(speeds) + " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        size, ratio, speed = row["bytes"], row["ratio_to_entropy"], row["positions_per_second"]
        cells = [f"{row['density']:.4f}", f"{row['entropy_bytes']:.0f}"]
        cells += [str(size[name]) for name in ("rice", "golomb", "zlib", "zstd")]
        cells += [f"{ratio[name]:.4f}" for name in ("rice", "golomb", "zlib", "zstd")]
        cells += [f"{speed[name] / 1e9:.2f}" for name in speed]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log2-n", type=int, default=24)
    parser.add_argument("--densities", default=",".join(map(str, DENSITIES)))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    n = 1 << args.log2_n
    rows = []
    for density in map(float, args.densities.split(",")):
        rows.append({"p": density, **measure(rng.random(n) < density, args.repeats)})
    print(f"n = 2**{args.log2_n} positions, seed {args.seed}, {args.repeats} repetitions.\n")
    print(LEGEND + "\n")
    print(markdown(rows))
    print()
    report = {
        "n": n,
        "seed": args.seed,
        "repeats": args.repeats,
        "timed": LEGEND,
        "machine": platform.processor() or platform.machine(),
        "numpy": np.__version__,
        "zstandard": zstandard.__version__,
        "rows": rows,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
