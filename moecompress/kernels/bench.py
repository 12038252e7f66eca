"""``moecompress bench kernels``: each Triton kernel against torch bf16 at decode and prefill shapes of real MoE
layers (Qwen3-30B-A3B, Mixtral-8x7B), plus the Golomb-Rice bitmap decoder.

On a GPU every timed call is preceded by a write of 256 MiB (so the weights come from HBM, not L2) and a ~1 ms
GPU spin (so the call's launches are queued before its start event runs, and a call that never waits on the host
is timed on the device alone); the figure is the median of the CUDA-event times after a warm-up. For the fused
MoE the two Triton kernels' own device time is also taken from the torch profiler. On CPU the torch (and numpy)
references are timed with ``time.perf_counter`` at reduced sizes; those are not kernel figures.

Weights are random codes: the figures depend on shapes, not values. The byte and FLOP accounting (functions
named ``*_bytes`` and ``*_flops``) is what the tests check by hand.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import golomb_rice
from .mxfp4 import BLOCK_SIZE

DECODE_TOKENS = (1, 4, 16)
PREFILL_TOKENS = 2048
W4A8_GROUP = 32  # QuantScheme's default group for w4a8 (symmetric)
BINARY_GROUP = 128  # DEFAULT_GROUP_SIZE["binary"]
BINARY_SALIENT = 0.01
GOLOMB_DENSITIES = (0.01, 0.05)
GOLOMB_CHUNKS = (golomb_rice.DEFAULT_CHUNK_SYMBOLS, 4096)
FLUSH_BYTES = 256 << 20
SPIN_CYCLES = 2_000_000  # ~1 ms at the H200's ~2 GHz
KNOWN_HBM_GBS = {"H200": 4800.0}
CPU_NOTE = "no GPU found: timing the torch references on CPU at reduced sizes; these are not kernel figures"
MOE_KERNELS = ("_moe_gate_up_kernel", "_moe_down_kernel")


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer: hidden size, routed experts, expert intermediate size, experts per token."""

    model: str
    hidden: int
    experts: int
    intermediate: int
    top_k: int

    def matrices(self) -> list[tuple[str, int, int]]:
        """One expert's weight matrices as ``(name, out_features, in_features)``."""
        return [("gate_up", 2 * self.intermediate, self.hidden), ("down", self.hidden, self.intermediate)]


MODELS = (
    MoEShape("Qwen3-30B-A3B", hidden=2048, experts=128, intermediate=768, top_k=8),
    MoEShape("Mixtral-8x7B", hidden=4096, experts=8, intermediate=14336, top_k=2),
)
GOLOMB_LENGTH = 2 * 14336 * 4096  # one Mixtral-8x7B expert's gate_up matrix


@dataclass(frozen=True)
class Setting:
    """How big and how often: ``shrink`` divides the layer sizes (1 on a GPU)."""

    name: str
    shrink: int
    prefill: int
    warmup: int
    repeats: int
    golomb_length: int


SETTINGS = {
    "gpu": Setting("gpu", shrink=1, prefill=PREFILL_TOKENS, warmup=5, repeats=20, golomb_length=GOLOMB_LENGTH),
    "cpu": Setting("cpu", shrink=8, prefill=256, warmup=1, repeats=3, golomb_length=GOLOMB_LENGTH // 8),
    "quick": Setting("quick", shrink=32, prefill=32, warmup=1, repeats=2, golomb_length=1 << 18),
}


# ---- accounting -------------------------------------------------------------------------------------------------
def mxfp4_bytes(rows: int, cols: int) -> int:
    """Packed E2M1 codes (4 bits) plus one E8M0 byte per 32 weights: 4.25 bits per weight."""
    return rows * cols // 2 + rows * cols // BLOCK_SIZE


def int4_bytes(rows: int, cols: int, group: int, symmetric: bool = True) -> int:
    """Packed INT4 codes plus a bf16 scale (and a uint8 zero point when asymmetric) per group."""
    groups = rows * cols // group
    return rows * cols // 2 + 2 * groups + (0 if symmetric else groups)


def binary_bytes(rows: int, cols: int, group: int, salient: int) -> int:
    """Sign bits plus a bf16 scale per group, and the salient correction the kernel reads: int32 row starts
    ``[rows + 1]`` and, per salient weight, an int32 row, an int32 column and an fp32 delta."""
    return rows * cols // 8 + 2 * (rows * cols // group) + 4 * (rows + 1) + 12 * salient


def bf16_bytes(rows: int, cols: int) -> int:
    return 2 * rows * cols


def linear_flops(tokens: int, rows: int, cols: int) -> int:
    return 2 * tokens * rows * cols


def expert_weights(shape: MoEShape) -> int:
    """Weights of one expert: ``gate_up`` ``[2I, H]`` and ``down`` ``[H, I]``."""
    return 3 * shape.hidden * shape.intermediate


def moe_flops(tokens: int, shape: MoEShape) -> int:
    """``2 · tokens · k · (multiply-adds of one expert)``."""
    return 2 * tokens * shape.top_k * expert_weights(shape)


def moe_weight_bytes(shape: MoEShape, routed: int, per_weight: Callable[[int, int], int] = mxfp4_bytes) -> int:
    """Bytes of the ``routed`` distinct experts' matrices: only those are read."""
    return routed * sum(per_weight(rows, cols) for _, rows, cols in shape.matrices())


def routed_experts(ids: torch.Tensor, num_experts: int) -> int:
    """Distinct experts that ``ids`` routes any token to."""
    flat = ids.reshape(-1)
    return int(flat[(flat >= 0) & (flat < num_experts)].unique().numel())


def positions_bytes(positions: int) -> int:
    """What the decoder writes: one int64 per set bit."""
    return 8 * positions


def rate(amount: float, ms: float | None) -> float | None:
    """``amount`` per second, in units of 10^9, for a time in ms."""
    return None if not ms else amount / (ms * 1e-3) / 1e9


# ---- timing -----------------------------------------------------------------------------------------------------
class Timer:
    """Median wall time of a call in ms: CUDA events on a GPU, ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device, warmup: int, repeats: int):
        self.device, self.warmup, self.repeats = device, warmup, repeats
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def __call__(self, fn: Callable[[], Any]) -> float:
        for _ in range(self.warmup):
            fn()
        if self.flush is None:
            return statistics.median(self._cpu_once(fn) for _ in range(self.repeats))
        return self._cuda_median(fn)

    @staticmethod
    def _cpu_once(fn: Callable[[], Any]) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    def _cuda_median(self, fn: Callable[[], Any]) -> float:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
        for start, end in zip(starts, ends, strict=True):
            self.flush.zero_()
            torch.cuda._sleep(SPIN_CYCLES)
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))

    def kernels_ms(self, fn: Callable[[], Any], names: tuple[str, ...]) -> float | None:
        """Mean device time per call of the kernels whose names start with one of ``names`` (torch profiler);
        None on CPU or when the profiler saw none of them."""
        if self.flush is None:
            return None
        from torch.profiler import ProfilerActivity, profile

        try:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(self.repeats):
                    self.flush.zero_()
                    fn()
                torch.cuda.synchronize()
        except RuntimeError:  # no CUPTI: the kernel-only figure is optional
            return None
        total = sum(e.time_range.elapsed_us() for e in prof.events() if e.name.startswith(names))
        return total / 1e3 / self.repeats if total else None


# ---- figures ----------------------------------------------------------------------------------------------------
@dataclass
class LinearFigure:
    """One dense kernel at one shape and token count (``ms`` the kernel's, or on CPU its reference's)."""

    kernel: str
    model: str
    matrix: str
    out_features: int
    in_features: int
    tokens: int
    weight_bytes: int
    flops: int
    ms: float
    bf16_ms: float
    gbs: float | None = None
    tflops: float | None = None
    ratio: float | None = None
    hbm_fraction: float | None = None

    def finish(self, hbm_gbs: float | None) -> None:
        self.gbs = rate(self.weight_bytes, self.ms)
        self.tflops = rate(self.flops / 1e3, self.ms)
        self.ratio = self.bf16_ms / self.ms if self.ms else None
        self.hbm_fraction = self.gbs / hbm_gbs if hbm_gbs and self.gbs else None


@dataclass
class MoEFigure:
    """The fused MXFP4 MoE at one token count, against bf16 experts."""

    model: str
    hidden: int
    experts: int
    intermediate: int
    top_k: int
    tokens: int
    experts_routed: int
    weight_bytes: int
    flops: int
    ms: float
    bf16_ms: float
    routing_ms: float
    kernels_ms: float | None
    gbs: float | None = None
    tflops: float | None = None
    ratio: float | None = None
    hbm_fraction: float | None = None
    kernels_gbs: float | None = None
    kernels_hbm_fraction: float | None = None

    def finish(self, hbm_gbs: float | None) -> None:
        self.gbs = rate(self.weight_bytes, self.ms)
        self.tflops = rate(self.flops / 1e3, self.ms)
        self.ratio = self.bf16_ms / self.ms if self.ms else None
        self.kernels_gbs = rate(self.weight_bytes, self.kernels_ms)
        if hbm_gbs:
            self.hbm_fraction = self.gbs / hbm_gbs if self.gbs else None
            self.kernels_hbm_fraction = self.kernels_gbs / hbm_gbs if self.kernels_gbs else None


@dataclass
class DecodeFigure:
    """Golomb-Rice decoding of one bitmap to its int64 set-bit positions."""

    code: str
    density: float
    length: int
    positions: int
    chunk_symbols: int
    chunks: int
    coded_bytes: int
    ms: float
    matches_reference: bool
    output_gbs: float | None = None
    positions_per_s: float | None = None
    bitmap_positions_per_s: float | None = None

    def finish(self) -> None:
        self.output_gbs = rate(positions_bytes(self.positions), self.ms)
        self.positions_per_s = rate(self.positions, self.ms)
        self.bitmap_positions_per_s = rate(self.length, self.ms)


@dataclass
class BenchResult:
    device: str
    gpu: bool
    setting: str
    note: str
    timing: str
    bf16_moe_baseline: str
    hbm_gbs: float | None
    linear: list[LinearFigure] = field(default_factory=list)
    moe: list[MoEFigure] = field(default_factory=list)
    golomb_rice: list[DecodeFigure] = field(default_factory=list)
    goals: list[dict[str, Any]] = field(default_factory=list)
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ---- the cases --------------------------------------------------------------------------------------------------
def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)


def reduced(shape: MoEShape, shrink: int) -> MoEShape:
    """``shape`` with sizes divided by ``shrink`` (multiples of 128, so every group size divides them) and fewer
    experts (at least ``2·top_k``)."""
    if shrink == 1:
        return shape
    return MoEShape(
        f"{shape.model} /{shrink}",
        hidden=_round_up(shape.hidden // shrink, 128),
        experts=min(shape.experts, max(shape.experts // shrink, 2 * shape.top_k)),
        intermediate=_round_up(shape.intermediate // shrink, 128),
        top_k=shape.top_k,
    )


def token_counts(setting: Setting) -> tuple[int, ...]:
    return (*DECODE_TOKENS, setting.prefill)


def _kernel_modules() -> SimpleNamespace:
    from . import triton_binary, triton_golomb_rice, triton_moe, triton_mxfp4, triton_w4a8

    return SimpleNamespace(
        mxfp4=triton_mxfp4, moe=triton_moe, w4a8=triton_w4a8, binary=triton_binary, golomb_rice=triton_golomb_rice
    )


class Bench:
    """The device, timer and random source of one benchmark run."""

    def __init__(self, device: torch.device, setting: Setting, repeats: int | None = None):
        self.device, self.setting = device, setting
        self.gpu = device.type == "cuda"
        self.timer = Timer(device, setting.warmup, repeats or setting.repeats)
        self.k = _kernel_modules()
        self.generator = torch.Generator(device=device).manual_seed(0)

    def randint(
        self, high: int, shape: tuple[int, ...], low: int = 0, dtype: torch.dtype = torch.uint8
    ) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.generator, dtype=dtype, device=self.device)

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator, device=self.device).mul_(scale).to(torch.bfloat16)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, device=self.device)


# ---- dense kernels ----------------------------------------------------------------------------------------------
LinearRun = Callable[[torch.Tensor], torch.Tensor]


def mxfp4_case(bench: Bench, rows: int, cols: int) -> tuple[LinearRun, int]:
    """The MXFP4 GEMM over random codes (scales near 2^-6), and its weight bytes."""
    packed = bench.randint(256, (rows, cols // 2))
    scales = bench.randint(124, (rows, cols // BLOCK_SIZE), low=118)
    fn = bench.k.mxfp4.mxfp4_linear if bench.gpu else bench.k.mxfp4.mxfp4_linear_reference
    return (lambda x: fn(x, packed, scales)), mxfp4_bytes(rows, cols)


def w4a8_case(bench: Bench, rows: int, cols: int) -> tuple[LinearRun, int]:
    """W4A8 (symmetric INT4, group 32, INT8 per-token activations quantised in torch inside the call)."""
    packed = bench.randint(256, (rows, cols // 2))
    scales = bench.randn(rows, cols // W4A8_GROUP, scale=0.01).abs()
    w4a8 = bench.k.w4a8
    fn = w4a8.w4a8_linear_triton if bench.gpu else w4a8.w4a8_linear_integer_reference
    return (lambda x: fn(x, packed, scales, None, W4A8_GROUP)), int4_bytes(rows, cols, W4A8_GROUP)


def salient_positions(bench: Bench, rows: int, cols: int) -> torch.Tensor:
    """About ``BINARY_SALIENT`` of the ``rows × cols`` flat positions, sorted and distinct."""
    count = max(1, round(BINARY_SALIENT * rows * cols))
    return torch.unique(bench.randint(rows * cols, (count,), dtype=torch.int64))


def binary_case(bench: Bench, rows: int, cols: int) -> tuple[LinearRun, int]:
    """Binary weights (group 128) with 1% salient weights as the kernel's CSR correction."""
    packed = bench.randint(256, (rows, cols // 8))
    scales = bench.randn(rows, cols // BINARY_GROUP, scale=0.02).abs()
    positions = salient_positions(bench, rows, cols)
    values = bench.randn(positions.numel(), scale=0.1)
    binary = bench.k.binary
    size = binary_bytes(rows, cols, BINARY_GROUP, positions.numel())
    if not bench.gpu:
        return (lambda x: binary.binary_linear_reference(x, packed, scales, BINARY_GROUP, (positions, values))), size
    row_start = torch.searchsorted(positions, torch.arange(rows + 1, device=bench.device) * cols).to(torch.int32)
    deltas = bench.randn(positions.numel(), scale=0.1).float()
    correction = binary.SalientCorrection(
        row_start, (positions // cols).to(torch.int32), (positions % cols).to(torch.int32), deltas
    )
    return (lambda x: binary.binary_linear(x, packed, scales, BINARY_GROUP, correction)), size


LINEAR_CASES: dict[str, Callable[[Bench, int, int], tuple[LinearRun, int]]] = {
    "mxfp4_linear": mxfp4_case,
    "w4a8_linear": w4a8_case,
    "binary_linear": binary_case,
}


def bench_linear(bench: Bench, shape: MoEShape, progress: Callable[[str], None]) -> list[LinearFigure]:
    """Every dense kernel on both of one expert's matrices, at every token count, with the bf16 baseline."""
    figures = []
    for matrix, rows, cols in shape.matrices():
        weight = bench.randn(rows, cols, scale=0.02)
        inputs = {t: bench.randn(t, cols) for t in token_counts(bench.setting)}
        baseline = {t: bench.timer(partial(F.linear, x, weight)) for t, x in inputs.items()}
        for kernel, build in LINEAR_CASES.items():
            progress(f"{kernel} {shape.model} {matrix} [{rows}×{cols}]")
            run, size = build(bench, rows, cols)
            for tokens, x in inputs.items():
                ms = bench.timer(partial(run, x))
                flops = linear_flops(tokens, rows, cols)
                figures.append(
                    LinearFigure(kernel, shape.model, matrix, rows, cols, tokens, size, flops, ms, baseline[tokens])
                )
    return figures


# ---- fused MoE --------------------------------------------------------------------------------------------------
def grouped_mm_name() -> str:
    return "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "a per-expert torch.matmul loop"


def grouped_matmul(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``offsets[e-1]:offsets[e]`` of ``x`` times ``weights[e]`` (``[E, K, N]``), in bf16."""
    if hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, weights, offs=offsets)
    out, start = [], 0
    for expert, end in enumerate(offsets.tolist()):
        out.append(x[start:end] @ weights[expert])
        start = end
    return torch.cat(out)


def bf16_moe(
    hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The bf16 baseline: pairs sorted by expert, ``gate_up`` ``[E, H, 2I]`` and ``down`` ``[E, I, H]`` as grouped
    matmuls with SiLU·up between, outputs weighted and summed per token (no host sync)."""
    top_k, inter = ids.shape[1], down.shape[1]
    flat = ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.arange(gate_up.shape[0], device=flat.device, dtype=flat.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds, right=True).to(torch.int32)
    tokens = order // top_k
    gu = grouped_matmul(hidden[tokens], gate_up, offsets)
    y = grouped_matmul(F.silu(gu[:, :inter]) * gu[:, inter:], down, offsets)
    y = y.float() * weights.reshape(-1)[order, None].float()
    return (
        torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device).index_add_(0, tokens, y).to(hidden.dtype)
    )


def random_routing(bench: Bench, tokens: int, shape: MoEShape) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform routing: ``top_k`` distinct experts per token and softmax routing weights."""
    ids = bench.rand(tokens, shape.experts).topk(shape.top_k, dim=1).indices
    return ids, torch.softmax(bench.rand(tokens, shape.top_k), dim=1)


def mxfp4_experts(bench: Bench, shape: MoEShape) -> Any:
    """Random MXFP4 experts (scales near 2^-6) as the fused kernel takes them."""
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    return bench.k.moe.MXFP4Experts(
        bench.randint(256, (e, 2 * i, h // 2)),
        bench.randint(124, (e, 2 * i, h // BLOCK_SIZE), low=118),
        bench.randint(256, (e, h, i // 2)),
        bench.randint(124, (e, h, i // BLOCK_SIZE), low=118),
    )


def bench_moe(bench: Bench, shape: MoEShape, progress: Callable[[str], None]) -> list[MoEFigure]:
    """The fused MXFP4 MoE (its reference on CPU) against bf16 experts through :func:`bf16_moe`."""
    moe = bench.k.moe
    from .moe_routing import group_pairs

    progress(f"fused_moe_mxfp4 {shape.model}")
    experts = mxfp4_experts(bench, shape)
    gate_up = bench.randn(shape.experts, 2 * shape.intermediate, shape.hidden, scale=0.02).transpose(1, 2)
    down = bench.randn(shape.experts, shape.hidden, shape.intermediate, scale=0.02).transpose(1, 2)
    fused = moe.fused_moe_mxfp4 if bench.gpu else moe.fused_moe_reference
    activation = moe.Activation("silu")
    figures = []
    for tokens in token_counts(bench.setting):
        ids, weights = random_routing(bench, tokens, shape)
        hidden = bench.randn(tokens, shape.hidden)
        block = moe.moe_config(ids.numel(), shape.experts).block_m
        call = partial(fused, hidden, ids, weights, experts, activation)

        routed = routed_experts(ids, shape.experts)
        figures.append(
            MoEFigure(
                shape.model,
                shape.hidden,
                shape.experts,
                shape.intermediate,
                shape.top_k,
                tokens,
                routed,
                moe_weight_bytes(shape, routed),
                moe_flops(tokens, shape),
                ms=bench.timer(call),
                bf16_ms=bench.timer(partial(bf16_moe, hidden, ids, weights, gate_up, down)),
                routing_ms=bench.timer(partial(group_pairs, ids, shape.experts, block)),
                kernels_ms=bench.timer.kernels_ms(call, MOE_KERNELS) if bench.gpu else None,
            )
        )
    return figures


# ---- Golomb-Rice ------------------------------------------------------------------------------------------------
def random_positions(length: int, density: float, seed: int = 0) -> np.ndarray:
    """Sorted set-bit positions of a ``length``-position bitmap whose bits are set independently with ``density``."""
    rng = np.random.default_rng(seed)
    gaps = rng.geometric(density, int(length * density * 1.1) + 64)
    positions = np.cumsum(gaps) - 1
    return positions[positions < length]


def bench_golomb_rice(bench: Bench, progress: Callable[[str], None]) -> list[DecodeFigure]:
    """Rice-coded bitmaps at each density and chunk size, decoded by the Triton kernel (numpy on CPU)."""
    figures = []
    length = bench.setting.golomb_length
    for density in GOLOMB_DENSITIES:
        positions = random_positions(length, density)
        for chunk in GOLOMB_CHUNKS:
            progress(f"golomb_rice decode: density {density:g}, {chunk} symbols per chunk")
            data = golomb_rice.encode_indices(positions, length, code="rice", chunk_symbols=chunk)
            if bench.gpu:
                container = bench.k.golomb_rice.GPUContainer(data, bench.device)
                decode = bench.k.golomb_rice.decode_positions
                ms = bench.timer(partial(decode, container, check=False))
                matches = bool(np.array_equal(decode(container).cpu().numpy(), positions))
            else:
                ms = bench.timer(partial(golomb_rice.decode_indices, data))
                matches = bool(np.array_equal(golomb_rice.decode_indices(data), positions))
            chunks = golomb_rice.chunk_count(data)
            figures.append(DecodeFigure("rice", density, length, positions.size, chunk, chunks, len(data), ms, matches))
    return figures


# ---- the run ----------------------------------------------------------------------------------------------------
def hbm_peak_gbs(device: torch.device) -> float | None:
    """The HBM bandwidth of a known GPU (GB/s), else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((gbs for key, gbs in KNOWN_HBM_GBS.items() if key in name), None)


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    threads = torch.get_num_threads()
    return f"CPU, {threads} thread{'s' if threads != 1 else ''} (torch {torch.__version__})"


def timing_method(bench: Bench) -> str:
    t = bench.timer
    if bench.gpu:
        return (
            f"median of {t.repeats} CUDA-event timings after {t.warmup} warm-up calls; before each, a 256 MiB write "
            "(L2 flushed) and a ~1 ms GPU spin (launches queued ahead); kernels ms: torch profiler device time"
        )
    return f"median of {t.repeats} time.perf_counter timings after {t.warmup} warm-up calls"


def run_benchmark(
    quick: bool = False,
    repeats: int | None = None,
    hbm_gbs: float | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> BenchResult:
    """Every case on the GPU if there is one, else the references on CPU at reduced sizes."""
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    setting = SETTINGS["quick" if quick else "gpu" if device.type == "cuda" else "cpu"]
    bench = Bench(device, setting, repeats)
    hbm_gbs = hbm_gbs or hbm_peak_gbs(device)
    result = BenchResult(
        describe(device),
        bench.gpu,
        setting.name,
        "" if bench.gpu else CPU_NOTE,
        timing_method(bench),
        grouped_mm_name(),
        hbm_gbs,
    )
    for shape in (reduced(s, setting.shrink) for s in MODELS):
        result.linear += bench_linear(bench, shape, progress)
        result.moe += bench_moe(bench, shape, progress)
        if bench.gpu:
            torch.cuda.empty_cache()
    result.golomb_rice = bench_golomb_rice(bench, progress)
    for figure in (*result.linear, *result.moe):
        figure.finish(hbm_gbs)
    for decoded in result.golomb_rice:
        decoded.finish()
    result.goals = goal_checks(result)
    result.wall_s = time.perf_counter() - started
    return result


# ---- goals and the report ---------------------------------------------------------------------------------------
def goal_checks(result: BenchResult) -> list[dict[str, Any]]:
    """Issue #9's targets, case by case; only on a GPU (the CPU figures are references)."""
    if not result.gpu:
        return []
    goals = []
    for m in result.moe:
        if m.tokens > max(DECODE_TOKENS):
            continue
        case = f"{m.model} T={m.tokens}"
        if m.hbm_fraction is not None:
            goals.append(_goal("fused MoE call ≥ 70% of HBM on weight bytes", case, m.hbm_fraction, 0.7))
        if m.kernels_hbm_fraction is not None:
            goals.append(_goal("fused MoE kernels ≥ 70% of HBM on weight bytes", case, m.kernels_hbm_fraction, 0.7))
        if m.ratio is not None:
            goals.append(_goal("fused MoE ≥ 2.5× faster than bf16", case, m.ratio, 2.5))
    for d in result.golomb_rice:
        case = f"density {d.density:g}, chunk {d.chunk_symbols}"
        goals.append(_goal("Golomb-Rice decode ≥ 100 GB/s of int64 positions", case, d.output_gbs or 0.0, 100.0))
    return goals


def _goal(goal: str, case: str, value: float, target: float) -> dict[str, Any]:
    return {"goal": goal, "case": case, "value": value, "target": target, "met": value >= target}


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if value == 0 or abs(value) >= 10 ** (digits - 1):
        return f"{value:.0f}"
    return f"{value:.{max(0, digits - 1 - math.floor(math.log10(abs(value))))}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """Aligned columns, the first two left-aligned; a column with no figure in any row ("-") is left out."""
    keep = [i for i in range(len(headers)) if not rows or any(r[i] != "-" for r in rows)]
    headers, rows = [headers[i] for i in keep], [[r[i] for i in keep] for r in rows]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for row in [headers, *rows]:
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def linear_table(figures: list[LinearFigure]) -> str:
    headers = ["kernel", "matrix", "tokens", "weight MB", "ms", "GB/s", "%HBM", "TFLOP/s", "bf16 ms", "×bf16"]
    rows = [
        [
            f.kernel,
            f"{f.model} {f.matrix} [{f.out_features}×{f.in_features}]",
            str(f.tokens),
            _fmt(f.weight_bytes / 1e6),
            _fmt(f.ms),
            _fmt(f.gbs),
            _pct(f.hbm_fraction),
            _fmt(f.tflops),
            _fmt(f.bf16_ms),
            _fmt(f.ratio),
        ]
        for f in figures
    ]
    return table(headers, rows)


def moe_table(figures: list[MoEFigure]) -> str:
    headers = ["model", "layer", "tokens", "routed", "weight MB", "ms", "GB/s", "%HBM", "TFLOP/s", "bf16 ms", "×bf16"]
    headers += ["routing ms", "kernels ms", "kernels GB/s", "kernels %HBM"]
    rows = [
        [
            m.model,
            f"H {m.hidden}, I {m.intermediate}, E {m.experts}, top-{m.top_k}",
            str(m.tokens),
            str(m.experts_routed),
            _fmt(m.weight_bytes / 1e6),
            _fmt(m.ms),
            _fmt(m.gbs),
            _pct(m.hbm_fraction),
            _fmt(m.tflops),
            _fmt(m.bf16_ms),
            _fmt(m.ratio),
            _fmt(m.routing_ms),
            _fmt(m.kernels_ms),
            _fmt(m.kernels_gbs),
            _pct(m.kernels_hbm_fraction),
        ]
        for m in figures
    ]
    return table(headers, rows)


def golomb_table(figures: list[DecodeFigure]) -> str:
    headers = ["code", "density", "bitmap", "set bits", "chunk", "chunks", "coded MB", "ms", "Gpos/s", "GB/s int64"]
    headers += ["Gbitmap/s", "matches"]
    rows = [
        [
            d.code,
            f"{d.density:g}",
            str(d.length),
            str(d.positions),
            str(d.chunk_symbols),
            str(d.chunks),
            _fmt(d.coded_bytes / 1e6),
            _fmt(d.ms),
            _fmt(d.positions_per_s),
            _fmt(d.output_gbs),
            _fmt(d.bitmap_positions_per_s),
            "yes" if d.matches_reference else "NO",
        ]
        for d in figures
    ]
    return table(headers, rows)


def format_report(result: BenchResult) -> str:
    """The human-readable report: header, the three tables with their definitions, goals, wall time."""
    what = "Triton kernels" if result.gpu else "torch references (kernels: Triton on a GPU)"
    lines = [f"device   {result.device}", f"setting  {result.setting}: {what}", f"timing   {result.timing}"]
    if result.note:
        lines.insert(0, result.note)
    lines += [
        "",
        "dense kernels (one expert's matrix; bf16 = torch.nn.functional.linear in bf16; weight MB = 10^6 bytes of "
        "codes + scales read; GB/s = weight bytes / time; TFLOP/s = 2·tokens·rows·cols / time; ×bf16 = bf16 ms / ms)",
        f"  w4a8: symmetric INT4 group {W4A8_GROUP} + INT8 per-token activations; binary: group {BINARY_GROUP}, "
        f"{BINARY_SALIENT:.0%} salient weights (CSR correction counted in its bytes)",
        linear_table(result.linear),
        "",
        "fused MXFP4 MoE (random uniform routing; routed = distinct experts hit, only their weights counted; "
        f"TFLOP/s = 2·tokens·top-k·3·H·I / time; bf16 = sort + {result.bf16_moe_baseline} + SiLU·up + weighted sum; "
        "routing ms = group_pairs alone"
        + ("; kernels = the two Triton kernels' device time, torch profiler)" if result.gpu else ")"),
        moe_table(result.moe),
        "",
        "Golomb-Rice decode (Rice code, random bitmap; Gpos/s = 10^9 set-bit positions per second; GB/s int64 = "
        "set bits × 8 bytes (int64 as decode_positions writes them) / time; Gbitmap/s = 10^9 bitmap positions "
        "covered per second, i.e. GB/s of a bool bitmap; matches = positions equal the encoded ones)",
        golomb_table(result.golomb_rice),
        "",
    ]
    lines += goal_lines(result)
    lines.append(f"total wall time {result.wall_s:.1f} s")
    return "\n".join(lines)


def goal_lines(result: BenchResult) -> list[str]:
    if not result.gpu:
        return ["goals: not checked (no GPU; these are reference timings)"]
    if not result.goals:
        return ["goals: none checked"]
    peak = f" (HBM peak taken as {result.hbm_gbs:.0f} GB/s)" if result.hbm_gbs else " (HBM peak unknown: --hbm-gbs)"
    lines = [f"goals{peak}:"]
    for g in result.goals:
        value = _pct(g["value"]) if "HBM" in g["goal"] else _fmt(g["value"])
        lines.append(f"  {'met    ' if g['met'] else 'NOT met'}  {g['goal']}: {g['case']}: {value}")
    return lines
