"""W4A8 GEMM: INT4 group-wise weights (:mod:`.intq` layout: codes ``[N, K/2]``, bf16 scales ``[N, K/G]``,
uint8 zero points ``[N, K/G]`` when asymmetric) times INT8 per-token activations (:mod:`.w4a8`).

Each K step covers one weight group: ``Σ q_x · (q_w − z)`` is an int8 × int8 ``tl.dot`` with int32 accumulation
(exact), then scaled by the group's ``s_w`` into an fp32 accumulator; the token's ``s_x`` multiplies once at the
end. :func:`w4a8_integer_reference` is the definition, with the fp32 operations in the kernel's order, so the
interpreter matches it bit for bit; on a GPU, fused multiply-adds may move the last bit.

This is the integer product; the module's older reference (:func:`.w4a8.w4a8_linear`) rounds the dequantised
weights and activations to bf16 first, so the two differ at bf16 precision.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .packing import unpack_codes
from .w4a8 import quantize_activations


def w4a8_integer_reference(
    codes_x: torch.Tensor,
    scale_x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``[M, N]``: ``s_x · Σ_g s_w[g] · Σ_{k∈g} q_x · (q_w − z)``, groups summed in order, then ``+ bias``."""
    weight_codes = unpack_codes(packed, 4).to(torch.int64)
    rows, cols = weight_codes.shape
    groups = cols // group_size
    zero = torch.full((rows, groups), 8, dtype=torch.int64) if zeros is None else zeros.to(torch.int64)
    centred = weight_codes.reshape(rows, groups, group_size) - zero.to(weight_codes.device)[:, :, None]
    qx = codes_x.to(torch.int64).reshape(codes_x.shape[0], groups, group_size)
    out = torch.zeros(codes_x.shape[0], rows, dtype=torch.float32, device=codes_x.device)
    for group in range(groups):
        exact = (qx[:, group].double() @ centred[:, group].double().T).float()
        out = out + exact * scales[:, group].float()
    out = out * scale_x.float().reshape(-1, 1)
    if bias is not None:
        out = out + bias.float()
    return out


@triton.jit
def _w4a8_kernel(
    x_ptr,
    sx_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_s,
    stride_out,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for group in range(0, K // GROUP):
        rk = group * GROUP + tl.arange(0, GROUP)
        qx = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=m_mask[:, None], other=0)
        cols = group * (GROUP // 2) + tl.arange(0, GROUP // 2)
        packed = tl.load(w_ptr + rn[:, None] * stride_w + cols[None, :], mask=n_mask[:, None], other=0)
        packed = packed.to(tl.int32)
        codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, GROUP))
        if HAS_ZEROS:
            zero = tl.load(z_ptr + rn * stride_s + group, mask=n_mask, other=0).to(tl.int32)
        else:
            zero = tl.full((BLOCK_N,), 8, tl.int32)
        centred = (codes - zero[:, None]).to(tl.int8)
        exact = tl.dot(qx, tl.trans(centred), out_dtype=tl.int32)
        scale = tl.load(s_ptr + rn * stride_s + group, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc + exact.to(tl.float32) * scale[None, :]
    acc = acc * tl.load(sx_ptr + rm, mask=m_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None] * stride_out + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def w4a8_config(rows: int) -> dict[str, int]:
    if rows <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}


def w4a8_matmul(
    codes_x: torch.Tensor,
    scale_x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """The Triton twin of :func:`w4a8_integer_reference`, fp32 ``[M, N]`` (the caller rounds once)."""
    m, k = codes_x.shape
    n = packed.shape[0]
    codes_x, scale_x = codes_x.contiguous(), scale_x.reshape(-1).float().contiguous()
    packed, scales = packed.contiguous(), scales.contiguous()
    out = torch.empty((m, n), dtype=torch.float32, device=codes_x.device)
    config = config or w4a8_config(m)
    grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
    _w4a8_kernel[grid](
        codes_x,
        scale_x,
        packed,
        scales,
        zeros.contiguous() if zeros is not None else packed,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        codes_x.stride(0),
        packed.stride(0),
        scales.stride(0),
        out.stride(0),
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None,
        GROUP=group_size,
        **config,
    )
    return out


def w4a8_linear_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [..., K]`` quantised per token to INT8 (:func:`.w4a8.quantize_activations`, in torch), then
    :func:`w4a8_matmul`; returned in ``x``'s dtype."""
    rows = x.reshape(-1, x.shape[-1])
    codes_x, scale_x = quantize_activations(rows)
    out = w4a8_matmul(codes_x, scale_x, packed, scales, zeros, group_size, bias)
    return out.to(x.dtype).reshape(*x.shape[:-1], packed.shape[0])


def w4a8_linear_integer_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """What :func:`w4a8_linear_triton` computes, in torch."""
    rows = x.reshape(-1, x.shape[-1])
    codes_x, scale_x = quantize_activations(rows)
    out = w4a8_integer_reference(codes_x, scale_x, packed, scales, zeros, group_size, bias)
    return out.to(x.dtype).reshape(*x.shape[:-1], packed.shape[0])
