"""MXFP4 weight × bf16 activation GEMM: ``x [M, K] @ W.T`` with ``W [N, K]`` stored as :mod:`.mxfp4` packs it
(codes ``[N, K/2]``, E8M0 scales ``[N, K/32]``).

Each program owns a ``BLOCK_M × BLOCK_N`` output tile and walks K, dequantising a ``BLOCK_N × BLOCK_K`` weight
tile in registers (E2M1 code → fp32 bits, times the power-of-two scale, both exact in bf16) before ``tl.dot``
with fp32 accumulation. The weight is read from memory once per M tile, so at decode (M ≤ 16, one M tile) the
kernel streams the 4.25-bit weights once. :func:`mxfp4_linear_reference` is the definition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .mxfp4 import dequantize_mxfp4
from .triton_support import dot_dtype


def mxfp4_linear_reference(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ dequantize(W).T (+ bias)`` accumulated in fp32, returned in ``x``'s dtype."""
    out = x.float() @ dequantize_mxfp4(packed, scales).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


@triton.jit
def round_to_bf16(x):
    """fp32 values rounded to the nearest bf16 (ties to even), still fp32; the interpreter's own cast truncates."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & -65536).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to_fp32(code):
    """E2M1 codes (int32, 0..15) to fp32 through the bit pattern: ``s e1 e0 m`` → sign, exponent ``e + 126``,
    mantissa ``m``; exponent 0 is the subnormal ``0.5·m``."""
    sign = (code >> 3) << 31
    exponent = (code >> 1) & 3
    mantissa = code & 1
    normal = ((exponent + 126) << 23) | (mantissa << 22)
    bits = tl.where(exponent == 0, mantissa * (126 << 23), normal) | sign
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_fp32(scale):
    """E8M0 scale bytes (int32) to ``2 ** (s - 127)``; 0 is the subnormal ``2 ** -127``."""
    return tl.where(scale == 0, 2.0**-127, (scale << 23).to(tl.float32, bitcast=True))


@triton.jit
def mxfp4_tile(w_ptr, s_ptr, rows, row_mask, k0, K, stride_w, stride_s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The dequantised fp32 tile ``W[rows, k0 : k0 + BLOCK_K]`` (zeros where masked)."""
    cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    mask = row_mask[:, None] & (cols < K // 2)[None, :]
    packed = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=mask, other=0).to(tl.int32)
    codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, BLOCK_K))
    blocks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    smask = row_mask[:, None] & (blocks < K // 32)[None, :]
    scale = tl.load(s_ptr + rows[:, None] * stride_s + blocks[None, :], mask=smask, other=127).to(tl.int32)
    values = tl.reshape(e2m1_to_fp32(codes), (BLOCK_N, BLOCK_K // 32, 32)) * e8m0_to_fp32(scale)[:, :, None]
    return tl.reshape(values, (BLOCK_N, BLOCK_K))


@triton.jit
def _mxfp4_matmul_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_w,
    stride_s,
    stride_om,
    HAS_BIAS: tl.constexpr,
    DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x_mask = m_mask[:, None] & (rk < K)[None, :]
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=x_mask, other=0.0).to(tl.float32)
        w = mxfp4_tile(w_ptr, s_ptr, rn, n_mask, k0, K, stride_w, stride_s, BLOCK_N, BLOCK_K)
        acc += tl.dot(x.to(DOT), tl.trans(w).to(DOT))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemm_config(rows: int) -> dict[str, int]:
    """Tile sizes by the number of activation rows: one 16-row tile and narrow N tiles at decode (many programs
    to stream the weights), square tiles for prefill."""
    if rows <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    if rows <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def output_buffer(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Where a kernel writes: fp32 under the interpreter (its bf16 stores truncate), ``x``'s dtype on a GPU."""
    return torch.empty(shape, dtype=torch.float32 if x.device.type == "cpu" else x.dtype, device=x.device)


def mxfp4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """The Triton twin of :func:`mxfp4_linear_reference` for ``x [..., K]``, ``packed [N, K/2]``."""
    n, k = packed.shape[0], packed.shape[1] * 2
    rows = x.reshape(-1, k).contiguous()
    packed, scales = packed.contiguous(), scales.contiguous()
    m = rows.shape[0]
    out = output_buffer(x, (m, n))
    config = config or gemm_config(m)
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
    _mxfp4_matmul_kernel[grid](
        rows,
        packed,
        scales,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        rows.stride(0),
        packed.stride(0),
        scales.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        DOT=dot_dtype(x),
        **config,
    )
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
