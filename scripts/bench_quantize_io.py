"""Is RTN quantisation I/O-bound? Time `moecompress quantize --method rtn` against copying the same files.

Synthesises a random bf16 Qwen3-MoE checkpoint (default about 1.6 GB), then, in one run and in this order:
copies its shard files to a new directory (cold and warm page cache are the same for both: the source was just
written), quantises it to MXFP4 (native format, no evaluation), and copies again. Prints one JSON object with
seconds and input GB/s for each, and the ratio of quantising time to the mean copying time.

Run: python scripts/bench_quantize_io.py [--layers 8] [--hidden 1024] [--experts 32] [--intermediate 768]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from moecompress.loading import quiet_transformers
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synthetic import write_synthetic_qwen3_moe


def copy_files(source: Path, target: Path) -> float:
    """Seconds to copy every file of ``source`` into ``target`` and fsync them."""
    start = time.perf_counter()
    target.mkdir()
    for path in sorted(source.iterdir()):
        shutil.copyfile(path, target / path.name)
        with open(target / path.name, "rb") as handle:
            os.fsync(handle.fileno())
    return time.perf_counter() - start


def fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--scheme", default="mxfp4")
    parser.add_argument("--dir", type=Path, default=None, help="Where to write (default: a temporary directory).")
    args = parser.parse_args()
    torch.set_num_threads(2)
    quiet_transformers()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        source = root / "source"
        write_synthetic_qwen3_moe(source, args.layers, args.hidden, args.experts, args.intermediate)
        fsync_tree(source)
        size = sum(p.stat().st_size for p in source.iterdir())
        copy_first = copy_files(source, root / "copy1")
        start = time.perf_counter()
        report = quantize_checkpoint(source, root / "quantized", QuantizeConfig(scheme=args.scheme), progress=False)
        fsync_tree(root / "quantized")
        quantize_seconds = time.perf_counter() - start
        copy_second = copy_files(source, root / "copy2")
        copy_mean = (copy_first + copy_second) / 2
        result = dict(
            date=time.strftime("%Y-%m-%d"),
            machine=f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
            torch=torch.__version__,
            checkpoint_bytes=size,
            output_bytes=report["footprint"]["file_bytes"],
            scheme=args.scheme,
            copy_seconds=[round(copy_first, 3), round(copy_second, 3)],
            quantize_seconds=round(quantize_seconds, 3),
            copy_gb_per_s=round(size / copy_mean / 1e9, 3),
            quantize_gb_per_s=round(size / quantize_seconds / 1e9, 3),
            quantize_over_copy=round(quantize_seconds / copy_mean, 3),
        )
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
