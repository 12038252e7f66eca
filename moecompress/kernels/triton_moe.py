"""Fused MXFP4 MoE: routed experts with MXFP4 ``gate_up [E, 2I, H]`` (gate rows first) and ``down [E, H, I]``,
optional biases and low-rank error adapters ``L·R`` per expert matrix, in two kernel launches.

1. ``gate_up``: a program per (row block of pairs routed to one expert, ``BLOCK_N`` intermediate columns)
   gathers its tokens' hidden rows, accumulates the gate and the up tile over H from the same loads, adds the
   bias and the adapters (``x·Rᵀ`` accumulated in the same K loop, then ``·Lᵀ``), applies the gated activation
   and writes ``h`` rounded to the activation dtype, one row per pair.
2. ``down``: the same row blocks over H columns; the adapter and bias as above, then the routing weight, and an
   fp32 atomic add into the token's output row (k adds per element).

Pairs are grouped by :func:`.moe_routing.group_pairs`. :func:`fused_moe_reference` is the definition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .moe_routing import group_pairs
from .mxfp4 import dequantize_mxfp4
from .triton_mxfp4 import mxfp4_tile, round_to_bf16
from .triton_support import dot_dtype

ACTIVATIONS = ("silu", "swigluoai")
MIN_RANK = 16


@dataclass(frozen=True)
class Activation:
    """The gated activation: ``silu(gate)·up``, or ``swigluoai`` (vLLM's name for GPT-OSS's clamped
    ``(up + 1)·gate·sigmoid(alpha·gate)``)."""

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.kind!r}; choose from {ACTIVATIONS}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


@dataclass(frozen=True)
class Adapters:
    """Per-expert low-rank factors, zero-padded to one rank: ``left [E, rows, R]``, ``right [E, R, cols]``."""

    left: torch.Tensor
    right: torch.Tensor

    @property
    def rank(self) -> int:
        return self.right.shape[1]


def pad_adapters(
    factors: dict[int, tuple[torch.Tensor, torch.Tensor]], num_experts: int, rows: int, cols: int, rank: int
) -> Adapters:
    """``factors[e] = (L [rows, r], R [r, cols])`` padded with zeros to ``rank`` (experts without one get zeros)."""
    reference = next(iter(factors.values()))[0]
    left = reference.new_zeros(num_experts, rows, rank)
    right = reference.new_zeros(num_experts, rank, cols)
    for expert, (lf, rf) in factors.items():
        left[expert, :, : lf.shape[1]] = lf
        right[expert, : rf.shape[0]] = rf
    return Adapters(left, right)


def padded_rank(ranks: list[int]) -> int:
    """The rank the kernels use: a power of two of at least 16 (``tl.dot``'s smallest inner size)."""
    return max(MIN_RANK, triton.next_power_of_2(max(ranks, default=1)))


@dataclass(frozen=True)
class MXFP4Experts:
    """An MoE block's MXFP4 experts as the kernels read them (see the module docstring for the shapes)."""

    gate_up: torch.Tensor
    gate_up_scales: torch.Tensor
    down: torch.Tensor
    down_scales: torch.Tensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    gate: Adapters | None = None
    up: Adapters | None = None
    down_adapter: Adapters | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.gate_up.shape[2] * 2

    @property
    def intermediate_size(self) -> int:
        return self.gate_up.shape[1] // 2

    @property
    def weight_bytes(self) -> int:
        tensors = (self.gate_up, self.gate_up_scales, self.down, self.down_scales)
        return sum(t.numel() * t.element_size() for t in tensors)


def _low_rank(x: torch.Tensor, adapters: Adapters | None, expert: int) -> torch.Tensor | float:
    if adapters is None:
        return 0.0
    return (x @ adapters.right[expert].float().T) @ adapters.left[expert].float().T


def fused_moe_reference(
    hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: MXFP4Experts, activation: Activation
) -> torch.Tensor:
    """Per expert: dequantise, ``gate_up`` (+ bias + adapters) in fp32, the activation, ``h`` rounded to
    ``hidden``'s dtype, ``down`` (+ adapter + bias) in fp32, times the routing weight, summed per token in fp32;
    returned in ``hidden``'s dtype. Ids outside ``[0, E)`` contribute nothing."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    inter = experts.intermediate_size
    for expert in ids.unique().tolist():
        if not 0 <= expert < experts.num_experts:
            continue
        token, slot = torch.where(ids == expert)
        x = hidden[token].float()
        gate_up = x @ dequantize_mxfp4(experts.gate_up[expert], experts.gate_up_scales[expert]).T
        if experts.gate_up_bias is not None:
            gate_up = gate_up + experts.gate_up_bias[expert].float()
        gate = gate_up[:, :inter] + _low_rank(x, experts.gate, expert)
        up = gate_up[:, inter:] + _low_rank(x, experts.up, expert)
        h = activation(gate, up).to(hidden.dtype).float()
        y = h @ dequantize_mxfp4(experts.down[expert], experts.down_scales[expert]).T
        y = y + _low_rank(h, experts.down_adapter, expert)
        if experts.down_bias is not None:
            y = y + experts.down_bias[expert].float()
        out.index_add_(0, token, y * weights[token, slot, None].float())
    return out.to(hidden.dtype)


@triton.jit
def _gated(gate, up, ACT: tl.constexpr, alpha, limit):
    if ACT == 0:
        return gate * tl.sigmoid(gate) * up
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (up + 1.0) * gate * tl.sigmoid(gate * alpha)


@triton.jit
def _block_rows(pairs_ptr, experts_ptr, num_pairs, BLOCK_M: tl.constexpr):
    expert = tl.load(experts_ptr + tl.program_id(0))
    pairs = tl.load(pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs, pairs < num_pairs


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,
    pairs_ptr,
    experts_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    rg_ptr,
    lg_ptr,
    ru_ptr,
    lu_ptr,
    h_ptr,
    num_pairs,
    top_k,
    H,
    inter,
    stride_x,
    stride_we,
    stride_w,
    stride_se,
    stride_s,
    stride_h,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    HAS_ADAPTER: tl.constexpr,
    RANK: tl.constexpr,
    ACT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert, pairs, valid = _block_rows(pairs_ptr, experts_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    tokens = (pairs // top_k).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < inter
    w_e = w_ptr + expert * stride_we
    s_e = s_ptr + expert * stride_se
    ranks = tl.arange(0, RANK)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xr_gate = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    xr_up = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < H
        x = tl.load(x_ptr + tokens[:, None] * stride_x + rk[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        x = x.to(tl.float32).to(DOT)
        wg = mxfp4_tile(w_e, s_e, rn, n_mask, k0, H, stride_w, stride_s, BLOCK_N, BLOCK_K)
        wu = mxfp4_tile(w_e, s_e, inter + rn, n_mask, k0, H, stride_w, stride_s, BLOCK_N, BLOCK_K)
        acc_gate += tl.dot(x, tl.trans(wg).to(DOT))
        acc_up += tl.dot(x, tl.trans(wu).to(DOT))
        if HAS_ADAPTER:
            r_offsets = expert * RANK * H + ranks[:, None] * H + rk[None, :]
            rg = tl.load(rg_ptr + r_offsets, mask=k_mask[None, :], other=0.0).to(tl.float32)
            ru = tl.load(ru_ptr + r_offsets, mask=k_mask[None, :], other=0.0).to(tl.float32)
            xr_gate += tl.dot(x, tl.trans(rg).to(DOT))
            xr_up += tl.dot(x, tl.trans(ru).to(DOT))
    if HAS_BIAS:
        bias = bias_ptr + expert * 2 * inter
        acc_gate += tl.load(bias + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(bias + inter + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_ADAPTER:
        l_offsets = expert * inter * RANK + rn[:, None] * RANK + ranks[None, :]
        lg = tl.load(lg_ptr + l_offsets, mask=n_mask[:, None], other=0.0).to(tl.float32)
        lu = tl.load(lu_ptr + l_offsets, mask=n_mask[:, None], other=0.0).to(tl.float32)
        acc_gate += tl.dot(xr_gate, tl.trans(lg), input_precision="ieee")
        acc_up += tl.dot(xr_up, tl.trans(lu), input_precision="ieee")
    h = _gated(acc_gate, acc_up, ACT, alpha, limit)
    if ROUND_BF16:
        h = round_to_bf16(h)
    out = h_ptr + pairs.to(tl.int64)[:, None] * stride_h + rn[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr,
    pairs_ptr,
    experts_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    rd_ptr,
    ld_ptr,
    route_ptr,
    out_ptr,
    num_pairs,
    top_k,
    H,
    inter,
    stride_h,
    stride_we,
    stride_w,
    stride_se,
    stride_s,
    stride_out,
    HAS_BIAS: tl.constexpr,
    HAS_ADAPTER: tl.constexpr,
    RANK: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert, pairs, valid = _block_rows(pairs_ptr, experts_ptr, num_pairs, BLOCK_M)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows = pairs.to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < H
    w_e = w_ptr + expert * stride_we
    s_e = s_ptr + expert * stride_se
    ranks = tl.arange(0, RANK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    hr = tl.zeros((BLOCK_M, RANK), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < inter
        h = tl.load(h_ptr + rows[:, None] * stride_h + rk[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        h = h.to(tl.float32).to(DOT)
        w = mxfp4_tile(w_e, s_e, rn, n_mask, k0, inter, stride_w, stride_s, BLOCK_N, BLOCK_K)
        acc += tl.dot(h, tl.trans(w).to(DOT))
        if HAS_ADAPTER:
            r_offsets = expert * RANK * inter + ranks[:, None] * inter + rk[None, :]
            rd = tl.load(rd_ptr + r_offsets, mask=k_mask[None, :], other=0.0).to(tl.float32)
            hr += tl.dot(h, tl.trans(rd).to(DOT))
    if HAS_ADAPTER:
        l_offsets = expert * H * RANK + rn[:, None] * RANK + ranks[None, :]
        ld = tl.load(ld_ptr + l_offsets, mask=n_mask[:, None], other=0.0).to(tl.float32)
        acc += tl.dot(hr, tl.trans(ld), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * H + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    route = tl.load(route_ptr + rows, mask=valid, other=0.0)
    acc = acc * route[:, None]
    tokens = rows // top_k
    tl.atomic_add(out_ptr + tokens[:, None] * stride_out + rn[None, :], acc, mask=valid[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def moe_config(num_pairs: int, num_experts: int) -> MoEConfig:
    """Row blocks sized to the pairs an expert gets on average: 16 at decode (each expert's weights streamed
    once per column tile), larger for prefill where the kernels turn compute-bound."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return MoEConfig(16, 64, 128, 4, 4)
    if per_expert <= 64:
        return MoEConfig(64, 64, 128, 4, 3)
    return MoEConfig(128, 128, 64, 8, 3)


def _adapter_args(adapters: Adapters | None, fallback: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if adapters is None:
        return fallback, fallback
    return adapters.right.contiguous(), adapters.left.contiguous()


def fused_moe_mxfp4(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: MXFP4Experts,
    activation: Activation,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """The Triton twin of :func:`fused_moe_reference` for ``hidden [T, H]``, ``ids``/``weights`` ``[T, k]``."""
    tokens, top_k = ids.shape
    num_experts, inter, width = experts.num_experts, experts.intermediate_size, experts.hidden_size
    if (experts.gate is None) != (experts.up is None):
        raise ValueError("gate and up adapters come together (pad the missing one with zeros)")
    if experts.gate is not None and experts.gate.rank != experts.up.rank:
        raise ValueError("gate and up adapters must share one padded rank")
    x = hidden.contiguous()
    config = config or moe_config(ids.numel(), num_experts)
    blocks = group_pairs(ids, num_experts, config.block_m)
    h = torch.empty((ids.numel(), inter), dtype=torch.float32 if x.device.type == "cpu" else x.dtype, device=x.device)
    out = torch.zeros((tokens, width), dtype=torch.float32, device=x.device)
    route = weights.reshape(-1).float().contiguous()
    gate_up, gate_up_scales = experts.gate_up.contiguous(), experts.gate_up_scales.contiguous()
    down, down_scales = experts.down.contiguous(), experts.down_scales.contiguous()
    rg, lg = _adapter_args(experts.gate, out)
    ru, lu = _adapter_args(experts.up, out)
    rd, ld = _adapter_args(experts.down_adapter, out)
    launch = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    tiles = {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k}
    num_blocks = blocks.experts.numel()
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, config.block_n))](
        x,
        blocks.pairs,
        blocks.experts,
        gate_up,
        gate_up_scales,
        out if experts.gate_up_bias is None else experts.gate_up_bias.contiguous(),
        rg,
        lg,
        ru,
        lu,
        h,
        blocks.num_pairs,
        top_k,
        width,
        inter,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        gate_up_scales.stride(0),
        gate_up_scales.stride(1),
        h.stride(0),
        float(activation.alpha),
        float(activation.limit),
        HAS_BIAS=experts.gate_up_bias is not None,
        HAS_ADAPTER=experts.gate is not None,
        RANK=experts.gate.rank if experts.gate is not None else MIN_RANK,
        ACT=ACTIVATIONS.index(activation.kind),
        ROUND_BF16=hidden.dtype == torch.bfloat16,
        DOT=dot_dtype(x),
        **tiles,
        **launch,
    )
    _moe_down_kernel[(num_blocks, triton.cdiv(width, config.block_n))](
        h,
        blocks.pairs,
        blocks.experts,
        down,
        down_scales,
        out if experts.down_bias is None else experts.down_bias.contiguous(),
        rd,
        ld,
        route,
        out,
        blocks.num_pairs,
        top_k,
        width,
        inter,
        h.stride(0),
        down.stride(0),
        down.stride(1),
        down_scales.stride(0),
        down_scales.stride(1),
        out.stride(0),
        HAS_BIAS=experts.down_bias is not None,
        HAS_ADAPTER=experts.down_adapter is not None,
        RANK=experts.down_adapter.rank if experts.down_adapter is not None else MIN_RANK,
        DOT=dot_dtype(x),
        **tiles,
        **launch,
    )
    return out.to(hidden.dtype)
