"""``QuantizedTensor.dequantize`` against the old torch path (``_dequantize_reference``), side by side.

For every scheme the routed experts of one Qwen3-30B-A3B layer (``--experts`` of them: gate_up ``[E, 1536, 2048]``
and down ``[E, 2048, 768]``, random bf16 weights, std 0.02) are quantised by round-to-nearest, then dequantised to
each output dtype by both paths on ``--threads`` threads. Weights/s counts both matrices; each figure is the best
of interleaved repetitions (background load hits both paths alike): wall time, and the process's CPU time (all
threads, user and system), which a loaded machine disturbs less; ``identical`` compares the two outputs' bits.

First a memory-speed reference per dtype: the same outputs allocated and filled once (and, apart, allocated and
touched once per page: the fresh pages alone); ``fill / old`` is the ratio a dequantisation writing at that fill
speed would reach. Prints a markdown table, the references, then one JSON object (with the load average at the
start and the end); exits 1 if an output differs from the old path's.

Run: python scripts/bench_dequant.py [--experts 8] [--threads 2] [--repeats 5] [--old-repeats 2]
     [--dtypes bfloat16,float32] [--schemes mxfp4-floor,...]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import numpy as np
import torch

from moecompress.quantization.scheme import QuantizedTensor, QuantScheme

GATE_UP, DOWN = (1536, 2048), (2048, 768)
SALIENT_FRACTION = 0.01
SCHEMES = {
    "mxfp4-floor": QuantScheme("mxfp4", scale_rule="floor"),
    "mxfp4-ceil": QuantScheme("mxfp4", scale_rule="ceil"),
    "int4-sym": QuantScheme("int4", symmetric=True),
    "int4-asym": QuantScheme("int4", symmetric=False),
    "int2-sym": QuantScheme("int2", symmetric=True),
    "int2-asym": QuantScheme("int2", symmetric=False),
    "w4a8": QuantScheme("w4a8"),
    "binary": QuantScheme("binary", group_size=128),
    "binary+salient": QuantScheme("binary", group_size=128, salient_fraction=SALIENT_FRACTION),
}


def quantized(scheme: QuantScheme, experts: int, generator: torch.Generator) -> list[QuantizedTensor]:
    out = []
    for rows, cols in (GATE_UP, DOWN):
        weight = (torch.randn(experts, rows, cols, generator=generator) * 0.02).to(torch.bfloat16)
        keep = None
        if scheme.salient_fraction:
            keep = torch.rand(weight.shape, generator=generator) < scheme.salient_fraction
        out.append(scheme.quantize(weight, keep))
    return out


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def measure(tensors: list[QuantizedTensor], dtype: torch.dtype, repeats: int, old_repeats: int) -> dict:
    best = {key: float("inf") for key in ("old", "new", "old_cpu", "new_cpu")}
    outputs: dict[str, list[torch.Tensor]] = {}
    for repeat in range(max(repeats, old_repeats)):
        for path, count in (("old", old_repeats), ("new", repeats)):
            if repeat >= count:
                continue
            outputs.pop(path, None)
            start, cpu_start = time.perf_counter(), time.process_time()
            if path == "old":
                outputs[path] = [q._dequantize_reference(dtype) for q in tensors]
            else:
                outputs[path] = [q.dequantize(dtype) for q in tensors]
            best[path] = min(best[path], time.perf_counter() - start)
            best[f"{path}_cpu"] = min(best[f"{path}_cpu"], time.process_time() - cpu_start)
    weights = sum(q.numel for q in tensors)
    pairs = zip(outputs["old"], outputs["new"], strict=True)
    identical = all(a.dtype == b.dtype and torch.equal(bits(a), bits(b)) for a, b in pairs)
    return {
        "weights": weights,
        "old_weights_per_s": weights / best["old"],
        "new_weights_per_s": weights / best["new"],
        "ratio": best["old"] / best["new"],
        "old_cpu_weights_per_s": weights / best["old_cpu"],
        "new_cpu_weights_per_s": weights / best["new_cpu"],
        "cpu_ratio": best["old_cpu"] / best["new_cpu"],
        "identical": identical,
    }


def fill_rate(dtype: torch.dtype, experts: int, repeats: int, touch_only: bool = False) -> float:
    """Weights/s of allocating the outputs of one call as the new path does (numpy memory) and writing every element
    once with torch's threaded ``fill_``: what memory speed allows a dequantisation that returns new tensors. With
    ``touch_only``, one element per 4 KiB page is written instead: the cost of the fresh pages alone (the kernel
    zeroes each page on first touch)."""
    bits_dtype = {2: np.int16, 4: np.int32, 8: np.int64}[torch.empty(0, dtype=dtype).element_size()]
    shapes = [(experts, *GATE_UP), (experts, *DOWN)]
    page = 4096 // np.dtype(bits_dtype).itemsize
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = [torch.from_numpy(np.empty(shape, bits_dtype)).view(dtype) for shape in shapes]
        for output in outputs:
            if touch_only:
                output.view(-1)[::page].fill_(1.0)
            else:
                output.fill_(1.0)
        best = min(best, time.perf_counter() - start)
        del outputs
    return sum(np.prod(shape) for shape in shapes) / best


def load_average() -> str:
    try:
        with open("/proc/loadavg") as handle:
            return " ".join(handle.read().split()[:3])
    except OSError:
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="repetitions of the new path (best counts)")
    parser.add_argument("--old-repeats", type=int, default=2, help="repetitions of the old path (best counts)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(args.seed)

    for scheme in SCHEMES.values():  # compile (or load) the kernels outside the timings
        for dtype in dtypes:
            scheme.quantize(torch.randn(2, 4, 256)).dequantize(dtype)

    fills = {str(dtype).removeprefix("torch."): fill_rate(dtype, args.experts, args.repeats) for dtype in dtypes}
    touches = {
        str(dtype).removeprefix("torch."): fill_rate(dtype, args.experts, args.repeats, touch_only=True)
        for dtype in dtypes
    }
    rows = []
    print(f"{args.experts} experts, gate_up {GATE_UP} + down {DOWN}, {args.threads} threads, torch {torch.__version__}")
    start_load = load_average()
    print(f"load average at the start: {start_load}")
    print()
    print("M weights/s by wall time, then by CPU time")
    print()
    print(
        "| scheme | dtype | old | new | new / old | old (CPU) | new (CPU) | new / old (CPU) | fill / old | identical |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for label in args.schemes.split(","):
        tensors = quantized(SCHEMES[label], args.experts, generator)
        for dtype in dtypes:
            result = measure(tensors, dtype, args.repeats, args.old_repeats)
            result.update(scheme=label, dtype=str(dtype).removeprefix("torch."))
            result["fill_ratio"] = fills[result["dtype"]] / result["old_weights_per_s"]
            rows.append(result)
            print(
                f"| {label} | {result['dtype']} | {result['old_weights_per_s'] / 1e6:.1f} | "
                f"{result['new_weights_per_s'] / 1e6:.0f} | {result['ratio']:.1f}x | "
                f"{result['old_cpu_weights_per_s'] / 1e6:.1f} | {result['new_cpu_weights_per_s'] / 1e6:.0f} | "
                f"{result['cpu_ratio']:.1f}x | {result['fill_ratio']:.1f}x | "
                f"{'yes' if result['identical'] else 'NO'} |",
                flush=True,
            )
    print()
    print(
        "Memory-speed reference, the same outputs allocated and filled (M weights/s): "
        + ", ".join(f"{name} {rate / 1e6:.0f}" for name, rate in fills.items())
        + "; allocated and touched once per page: "
        + ", ".join(f"{name} {rate / 1e6:.0f}" for name, rate in touches.items())
    )
    print(f"load average at the end: {load_average()}")
    print()
    summary = {
        "loadavg_start": start_load,
        "experts": args.experts,
        "threads": args.threads,
        "repeats": args.repeats,
        "old_repeats": args.old_repeats,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "rows": rows,
        "fill_weights_per_s": fills,
        "touch_weights_per_s": touches,
        "loadavg_end": load_average(),
    }
    print(json.dumps(summary))
    return 0 if all(row["identical"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
