"""Fused dequantise-and-multiply on CPU (numba): ``x @ Wᵀ`` for a few rows of ``x`` straight from packed MXFP4 or
4-bit group-wise integer codes, for the plugin's routed experts.

Each task decodes one weight row at a time into float32 scratch rows (in L1) and takes their dot products with
every input row, so the codes are read once and no dequantised matrix is ever written to memory: at decode
(one token per expert) that reads a quarter of the bytes a bf16 matmul reads. The codes are unpacked with float
operations (numba widens integer arithmetic to 64 bits, which halves the vector width), and the packing's
even/odd interleave is undone on the input side instead: the inputs' even and odd columns are split once, so the
decoded rows are dotted as they come.

The decoded weights are the reference's (:meth:`QuantScheme.values`): MXFP4 ``e2m1 · 2^e`` exactly, integers
``(c - z) · s`` rounded to bfloat16; the reference then converts them to the activation dtype (exact for bf16
and float32), so only the summation order differs. numba is optional:
:func:`available` is False without it and callers take the reference path.
"""

from __future__ import annotations

import numpy as np
import torch

from . import mxfp4
from .numba_threads import torch_thread_count

try:
    import numba
except ImportError:  # pragma: no cover - exercised only where numba is missing
    numba = None

_ROWS_PER_TASK = 32
"""Weight rows per parallel task: enough to amortise the task's scratch row."""


def available() -> bool:
    return numba is not None


if numba is not None:

    @numba.njit(inline="always", cache=True)
    def _dot_rows(x_low, x_high, low, high, out, row):
        """``out[:, row]``: each token's dot product with the decoded row, held as its even (``low``) and odd
        (``high``) columns, which is how the codes pack them (the inputs are split the same way)."""
        tokens, half = x_low.shape
        token = 0
        while token + 4 <= tokens:
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for col in range(half):
                w0, w1 = low[col], high[col]
                a0 += w0 * x_low[token, col] + w1 * x_high[token, col]
                a1 += w0 * x_low[token + 1, col] + w1 * x_high[token + 1, col]
                a2 += w0 * x_low[token + 2, col] + w1 * x_high[token + 2, col]
                a3 += w0 * x_low[token + 3, col] + w1 * x_high[token + 3, col]
            out[token, row], out[token + 1, row], out[token + 2, row], out[token + 3, row] = a0, a1, a2, a3
            token += 4
        while token < tokens:
            acc = np.float32(0.0)
            for col in range(half):
                acc += low[col] * x_low[token, col] + high[col] * x_high[token, col]
            out[token, row] = acc
            token += 1

    @numba.njit(inline="always", cache=True)
    def _nibbles(byte):
        """A packed byte's low and high 4-bit codes, as float32 (float operations vectorise in full width;
        numba widens integer ones to 64 bits)."""
        value = np.float32(byte)
        high = np.floor(value * np.float32(0.0625))
        return value - high * np.float32(16.0), high

    @numba.njit(inline="always", cache=True)
    def _e2m1(code):
        """The E2M1 value of ``code`` (float32 0..15): magnitudes 0..7 map to 0, 0.5, 1, 1.5, 2, 3, 4, 6, which
        is ``max(m / 2, m - 2, 2m - 8)``; codes 8..15 are their negatives."""
        sign = np.floor(code * np.float32(0.125))
        magnitude = code - np.float32(8.0) * sign
        two, eight = np.float32(2.0), np.float32(8.0)
        value = max(magnitude * np.float32(0.5), max(magnitude - two, two * magnitude - eight))
        return value - two * value * sign

    @numba.njit(parallel=True, fastmath=True, cache=True)
    def _mxfp4_matmul(x_low, x_high, packed, scales, out):
        rows, half = packed.shape
        for task in numba.prange((rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
            low = np.empty(half, np.float32)
            high = np.empty(half, np.float32)
            for row in range(task * _ROWS_PER_TASK, min(rows, (task + 1) * _ROWS_PER_TASK)):
                codes, row_scales = packed[row], scales[row]
                for block in range(half // 16):
                    scale, base = row_scales[block], block * 16
                    for j in range(16):  # range(start, stop) loops do not vectorise
                        code_low, code_high = _nibbles(codes[base + j])
                        low[base + j] = _e2m1(code_low) * scale
                        high[base + j] = _e2m1(code_high) * scale
                _dot_rows(x_low, x_high, low, high, out, row)

    @numba.njit(inline="always", cache=True)
    def _bf16_rounded(bits):
        """float32 ``bits`` rounded to the nearest bfloat16 (ties to even), as float32 bits: the reference rounds
        every integer weight ``(c - z) · s`` so."""
        return (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536

    @numba.njit(parallel=True, fastmath=True, cache=True)
    def _int4_matmul(x_low, x_high, packed, scales, zeros, group_size, out):
        rows, half = packed.shape
        group_bytes = group_size // 2
        for task in numba.prange((rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
            low = np.empty(half, np.float32)
            high = np.empty(half, np.float32)
            low_bits, high_bits = low.view(np.int32), high.view(np.int32)
            for row in range(task * _ROWS_PER_TASK, min(rows, (task + 1) * _ROWS_PER_TASK)):
                codes, row_scales, row_zeros = packed[row], scales[row], zeros[row]
                for group in range(half // group_bytes):
                    scale, zero, base = row_scales[group], row_zeros[group], group * group_bytes
                    for j in range(group_bytes):
                        code_low, code_high = _nibbles(codes[base + j])
                        low[base + j] = (code_low - zero) * scale
                        high[base + j] = (code_high - zero) * scale
                for j in range(half):
                    low_bits[j] = _bf16_rounded(low_bits[j])
                    high_bits[j] = _bf16_rounded(high_bits[j])
                _dot_rows(x_low, x_high, low, high, out, row)


def _split_rows(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``x``'s rows in float32, even and odd columns apart."""
    rows = x.reshape(-1, x.shape[-1]).float()
    return rows[:, 0::2].contiguous().numpy(), rows[:, 1::2].contiguous().numpy()


def _result(out: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(out).to(x.dtype).reshape(*x.shape[:-1], out.shape[1])


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ Wᵀ`` in ``x``'s dtype, ``W`` ``[N, K]`` given as MXFP4 codes ``[N, K/2]`` and E8M0 scales
    ``[N, K/32]`` (CPU tensors)."""
    low, high = _split_rows(x)
    out = np.empty((low.shape[0], packed.shape[0]), np.float32)
    block_scales = mxfp4.power_of_two(scales.to(torch.int32) - mxfp4.E8M0_BIAS)
    with torch_thread_count():
        _mxfp4_matmul(low, high, packed.contiguous().numpy(), block_scales.numpy(), out)
    return _result(out, x)


def int4_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """``x @ Wᵀ`` in ``x``'s dtype, ``W`` ``[N, K]`` given as INT4 codes ``[N, K/2]``, bf16 scales ``[N, K/G]``
    and uint8 zero points (None: symmetric, zero 8)."""
    low, high = _split_rows(x)
    out = np.empty((low.shape[0], packed.shape[0]), np.float32)
    zero_values = torch.full(scales.shape, 8.0) if zeros is None else zeros.float()
    with torch_thread_count():
        _int4_matmul(
            low, high, packed.contiguous().numpy(), scales.float().numpy(), zero_values.numpy(), group_size, out
        )
    return _result(out, x)
