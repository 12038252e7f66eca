"""Binary-weight GEMM/GEMV with per-group scales and the sparse salient-weight correction.

Weights are :mod:`.binary`'s: sign bits packed eight to a byte along K (``[N, K/8]``, element ``j`` of a byte in
bit ``j``), one bf16 scale ``α`` per group (``[N, K/G]``). Salient weights (kept exactly in bf16) enter as a
correction ``δ = v − (±α)`` at their positions, stored row-sorted (CSR): ``y = x·(α·S)ᵀ + Σ_{(n,k)} x[:, k]·δ``.

Each program owns a ``BLOCK_M × BLOCK_N`` output tile. Per group it expands the sign bits to ±1 (exact in bf16),
takes ``tl.dot`` with the activations and scales the partial sum by ``α``. Then it walks the salient entries of
its ``BLOCK_N`` rows (contiguous in the CSR order), gathers the activation columns they touch, multiplies by
``δ`` and scatters into the tile with a one-hot ``tl.dot``, all in the same pass. The same kernel is the GEMV:
at decode (M ≤ 16) there is a single, masked 16-row tile and the packed signs are streamed once.
:func:`binary_linear_reference` is the definition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .binary import sign_values
from .packing import unpack_codes
from .triton_mxfp4 import output_buffer
from .triton_support import dot_dtype


def binary_dequantize(packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 ``[N, K]`` of the binary codes, without salient weights."""
    codes = unpack_codes(packed, 1)
    rows, cols = codes.shape
    grouped = codes.reshape(rows, cols // group_size, group_size)
    return sign_values(grouped, scales.float().unsqueeze(-1)).reshape(rows, cols)


def binary_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    salient: tuple[torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ Wᵀ (+ bias)`` in fp32, returned in ``x``'s dtype; ``W`` the binary matrix with the salient weights
    ``(flat positions into [N, K], bf16 values)`` written in."""
    weight = binary_dequantize(packed, scales, group_size)
    if salient is not None:
        positions, values = salient
        weight.view(-1)[positions.long()] = values.float()
    out = x.float() @ weight.T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@dataclass(frozen=True)
class SalientCorrection:
    """Row-sorted salient corrections: ``row_start [N + 1]``, ``rows``/``cols`` int32 and ``deltas`` fp32 ``[S]``."""

    row_start: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    deltas: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.rows.numel())


def salient_correction(
    positions: torch.Tensor, values: torch.Tensor, base: torch.Tensor, shape: tuple[int, int]
) -> SalientCorrection:
    """The correction for salient ``values`` at sorted flat ``positions`` of a ``shape`` matrix whose dense
    dequantised weights (without them) are ``base`` (any float view of that matrix)."""
    rows_count, cols_count = shape
    positions = positions.long()
    rows, cols = positions // cols_count, positions % cols_count
    deltas = values.float() - base.reshape(-1)[positions].float()
    bounds = torch.arange(rows_count + 1, device=positions.device) * cols_count
    row_start = torch.searchsorted(positions, bounds).to(torch.int32)
    return SalientCorrection(row_start, rows.to(torch.int32), cols.to(torch.int32), deltas.contiguous())


@triton.jit
def _binary_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    row_start_ptr,
    rows_ptr,
    cols_ptr,
    deltas_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_s,
    stride_out,
    HAS_SALIENT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    n0 = tl.program_id(1) * BLOCK_N
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    bit = tl.arange(0, 8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for group in range(0, K // GROUP):
        rk = group * GROUP + tl.arange(0, GROUP)
        x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=m_mask[:, None], other=0.0)
        cols = group * (GROUP // 8) + tl.arange(0, GROUP // 8)
        packed = tl.load(w_ptr + rn[:, None] * stride_w + cols[None, :], mask=n_mask[:, None], other=0)
        bits = (packed.to(tl.int32)[:, :, None] >> bit[None, None, :]) & 1
        signs = tl.reshape(bits * 2 - 1, (BLOCK_N, GROUP)).to(tl.float32)
        partial = tl.dot(x.to(tl.float32).to(DOT), tl.trans(signs).to(DOT))
        alpha = tl.load(s_ptr + rn * stride_s + group, mask=n_mask, other=0.0).to(tl.float32)
        acc += partial * alpha[None, :]
    if HAS_SALIENT:
        first = tl.load(row_start_ptr + n0)
        last = tl.load(row_start_ptr + tl.minimum(n0 + BLOCK_N, N))
        for start in range(first, last, BLOCK_S):
            entry = start + tl.arange(0, BLOCK_S)
            e_mask = entry < last
            col = tl.load(cols_ptr + entry, mask=e_mask, other=0)
            row = tl.load(rows_ptr + entry, mask=e_mask, other=-1) - n0
            delta = tl.load(deltas_ptr + entry, mask=e_mask, other=0.0)
            xs = tl.load(x_ptr + rm[:, None] * stride_x + col[None, :], mask=m_mask[:, None] & e_mask[None, :])
            weighted = xs.to(tl.float32) * delta[None, :]
            one_hot = (row[:, None] == tl.arange(0, BLOCK_N)[None, :]).to(tl.float32)
            acc += tl.dot(weighted, one_hot, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None] * stride_out + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def binary_config(rows: int) -> dict[str, int]:
    if rows <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_S": 32, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_S": 32, "num_warps": 8, "num_stages": 3}


def binary_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    correction: SalientCorrection | None = None,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """The Triton twin of :func:`binary_linear_reference` for ``x [..., K]`` (the salient weights given as the
    :class:`SalientCorrection` built from them)."""
    n, k = packed.shape[0], packed.shape[1] * 8
    rows = x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    packed, scales = packed.contiguous(), scales.contiguous()
    out = output_buffer(x, (m, n))
    config = config or binary_config(m)
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
    has_salient = correction is not None and correction.count > 0
    _binary_kernel[grid](
        rows,
        packed,
        scales,
        *(
            (correction.row_start, correction.rows, correction.cols, correction.deltas)
            if has_salient
            else (out, out, out, out)
        ),
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        rows.stride(0),
        packed.stride(0),
        scales.stride(0),
        out.stride(0),
        HAS_SALIENT=has_salient,
        HAS_BIAS=bias is not None,
        DOT=dot_dtype(x),
        GROUP=group_size,
        **config,
    )
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
