"""A fused CPU kernel for round-to-nearest MXFP4 (numba): one pass per block computes the block's largest
magnitude, its E8M0 exponent, the 32 E2M1 codes and their packing, where the torch reference makes a dozen
passes over memory. It is the same function, bit for bit (tests compare the two on awkward inputs); it exists
because quantising a checkpoint should run at disk speed, not at the speed of eager tensor operations.

numba is optional: :func:`available` is False without it and callers use the torch reference.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .numba_threads import torch_thread_count

try:
    import numba
except ImportError:  # pragma: no cover - exercised only where numba is missing
    numba = None


def available() -> bool:
    return numba is not None


_ROWS_PER_TASK = 16
"""Rows per parallel task: enough to amortise the task's scratch rows."""

if numba is not None:

    @numba.njit(inline="always", cache=True)
    def _e2m1(value):
        """The E2M1 code of a scaled value: its magnitude's rank among the midpoints of the grid (ties to the
        even code, hence the alternating ``>`` and ``>=``), plus the sign bit unless the code is zero. Written
        as a sum of comparisons so the compiler keeps it free of branches."""
        magnitude = abs(value)
        code = (
            np.int32(magnitude > 0.25)
            + np.int32(magnitude >= 0.75)
            + np.int32(magnitude > 1.25)
            + np.int32(magnitude >= 1.75)
            + np.int32(magnitude > 2.5)
            + np.int32(magnitude >= 3.5)
            + np.int32(magnitude > 5.0)
        )
        return code | ((np.int32(value < 0) & np.int32(code > 0)) << 3)

    @numba.njit(inline="always", cache=True)
    def _block_exponent(amax, ceil_rule):
        if amax == 0:
            return -127
        if ceil_rule:
            mantissa, power = math.frexp(np.float32(amax / np.float32(6.0)))
            exponent = power - 1 if mantissa == 0.5 else power
        else:
            exponent = math.frexp(amax)[1] - 3
        return min(127, max(-127, exponent))

    @numba.njit(cache=True)
    def _quantize_row(values, ceil_rule, packed, scales, codes):
        cols = values.shape[0]
        for block in range(cols // 32):
            start = block * 32
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(values[start + j]))
            exponent = _block_exponent(amax, ceil_rule)
            scales[block] = exponent + 127
            inverse = np.float32(math.ldexp(1.0, -exponent))
            for j in range(32):
                codes[start + j] = _e2m1(values[start + j] * inverse)
        for j in range(cols // 2):
            packed[j] = codes[2 * j] | (codes[2 * j + 1] << 4)

    @numba.njit(parallel=True, cache=True)
    def _quantize_rows(weights, ceil_rule, packed, scales):
        rows, cols = weights.shape
        for chunk in numba.prange((rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
            codes = np.empty(cols, np.int32)
            for row in range(chunk * _ROWS_PER_TASK, min(rows, (chunk + 1) * _ROWS_PER_TASK)):
                _quantize_row(weights[row], ceil_rule, packed[row], scales[row], codes)

    @numba.njit(inline="always", cache=True)
    def _bf16_value(bits):
        """The value of a bf16 bit pattern's magnitude, exactly (subnormals included)."""
        exponent_field = (np.int32(bits) >> 7) & 0xFF
        mantissa = np.int32(bits) & 0x7F
        if exponent_field == 0:
            return np.float32(math.ldexp(np.float32(mantissa), -133))
        return np.float32(math.ldexp(np.float32(mantissa | 0x80), exponent_field - 134))

    @numba.njit(cache=True)
    def _bf16_code_exact(bits, inverse):
        value = _bf16_value(bits) * inverse
        return _e2m1(-value if np.int32(bits) >> 15 else value)

    @numba.njit(parallel=True, cache=True)
    def _quantize_rows_bf16(bits, ceil_rule, codes_by_magnitude, packed, scales):
        """bf16 weights given as their bits, never widened whole. Scaling by a power of two only moves the
        exponent field, so a scaled magnitude's bits are the magnitude's bits minus ``exponent << 7`` and its
        E2M1 code is a lookup in ``codes_by_magnitude``. That holds while the scaled value stays normal: for a
        block exponent of -123 or more, anything that would leave the normal range is below 0.25 (code 0)
        either way. Lower exponents (blocks of tiny or zero weights) take the exact float path."""
        rows, cols = bits.shape
        for chunk in numba.prange((rows + _ROWS_PER_TASK - 1) // _ROWS_PER_TASK):
            for row in range(chunk * _ROWS_PER_TASK, min(rows, (chunk + 1) * _ROWS_PER_TASK)):
                for block in range(cols // 32):
                    start = block * 32
                    largest = 0
                    for j in range(32):
                        largest = max(largest, np.int32(bits[row, start + j] & np.uint16(0x7FFF)))
                    if ceil_rule:
                        exponent = _block_exponent(_bf16_value(largest), True)
                    else:  # floor(log2(amax)) - 2, read off the exponent field (zero and subnormals clamp)
                        exponent = max(-127, (largest >> 7) - 129)
                    scales[row, block] = exponent + 127
                    if exponent < -123:
                        inverse = np.float32(math.ldexp(1.0, -exponent))
                        for j in range(start, start + 32, 2):
                            low = _bf16_code_exact(bits[row, j], inverse)
                            high = _bf16_code_exact(bits[row, j + 1], inverse)
                            packed[row, j // 2] = low | (high << 4)
                        continue
                    shift = exponent << 7
                    for j in range(start, start + 32, 2):
                        low_bits, high_bits = np.int32(bits[row, j]), np.int32(bits[row, j + 1])
                        low = np.int32(codes_by_magnitude[max((low_bits & 0x7FFF) - shift, 0)])
                        high = np.int32(codes_by_magnitude[max((high_bits & 0x7FFF) - shift, 0)])
                        low |= ((low_bits >> 15) & np.int32(low > 0)) << 3
                        high |= ((high_bits >> 15) & np.int32(high > 0)) << 3
                        packed[row, j // 2] = low | (high << 4)

    @numba.njit(parallel=True, cache=True)
    def _codes_of_magnitudes(values):
        codes = np.empty(values.shape[0], np.uint8)
        for i in numba.prange(values.shape[0]):
            codes[i] = _e2m1(values[i])
        return codes


_CODES_BY_MAGNITUDE: np.ndarray | None = None


def _codes_by_magnitude() -> np.ndarray:
    """The E2M1 code of every non-negative bf16 bit pattern's value (32 KiB; NaN and Inf patterns, which a
    scaled weight never reaches, get 0)."""
    global _CODES_BY_MAGNITUDE
    if _CODES_BY_MAGNITUDE is None:
        values = torch.arange(0x8000, dtype=torch.int16).view(torch.bfloat16).float()
        values = torch.nan_to_num(values, nan=0.0, posinf=0.0)
        _CODES_BY_MAGNITUDE = _codes_of_magnitudes(values.numpy())
    return _CODES_BY_MAGNITUDE


def quantize_mxfp4(weight: torch.Tensor, scale_rule: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`moecompress.kernels.mxfp4.quantize_mxfp4`."""
    if numba is None:
        raise RuntimeError("numba is not installed")
    cols = weight.shape[-1]
    if cols % 32:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of 32, got {cols}")
    rows = weight.reshape(-1, cols).contiguous()
    packed = np.empty((rows.shape[0], cols // 2), dtype=np.uint8)
    scales = np.empty((rows.shape[0], cols // 32), dtype=np.uint8)
    with torch_thread_count():
        if rows.dtype == torch.bfloat16:
            bits = rows.view(torch.int16).numpy().view(np.uint16)
            _quantize_rows_bf16(bits, scale_rule == "ceil", _codes_by_magnitude(), packed, scales)
        else:
            _quantize_rows(rows.float().numpy(), scale_rule == "ceil", packed, scales)
    lead = weight.shape[:-1]
    return torch.from_numpy(packed).reshape(*lead, -1), torch.from_numpy(scales).reshape(*lead, -1)
