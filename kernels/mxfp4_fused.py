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

try:
    import numba
except ImportError:  # pragma: no cover - exercised only where numba is missing
    numba = None


def available() -> bool:
    return numba is not None


if numba is not None:

    @numba.njit(inline="always", cache=True)
    def _e2m1(value):
        magnitude = abs(value)
        code = 0
        if magnitude > 0.25:
            code = 1
        if magnitude >= 0.75:
            code = 2
        if magnitude > 1.25:
            code = 3
        if magnitude >= 1.75:
            code = 4
        if magnitude > 2.5:
            code = 5
        if magnitude >= 3.5:
            code = 6
        if magnitude > 5.0:
            code = 7
        if value < 0 and code > 0:
            code |= 8
        return code

    @numba.njit(parallel=True, cache=True)
    def _quantize_rows(weights, ceil_rule, packed, scales):
        for row in numba.prange(weights.shape[0]):
            _quantize_row(weights[row], ceil_rule, packed[row], scales[row])

    @numba.njit(cache=True)
    def _quantize_row(weights, ceil_rule, packed, scales):
        cols = weights.shape[0]
        six = np.float32(6.0)
        for block in range(cols // 32):
            start = block * 32
            amax = np.float32(0.0)
            for j in range(32):
                magnitude = abs(weights[start + j])
                if magnitude > amax:
                    amax = magnitude
            if amax == 0:
                exponent = -127
            elif ceil_rule:
                mantissa, power = math.frexp(np.float32(amax / six))
                exponent = power - 1 if mantissa == 0.5 else power
            else:
                exponent = math.frexp(amax)[1] - 3
            exponent = min(127, max(-127, exponent))
            scales[block] = exponent + 127
            inverse = np.float32(math.ldexp(1.0, -exponent))
            for j in range(0, 32, 2):
                low = _e2m1(weights[start + j] * inverse)
                high = _e2m1(weights[start + j + 1] * inverse)
                packed[(start + j) // 2] = low | (high << 4)


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
    numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
    _quantize_rows(rows.float().numpy(), scale_rule == "ceil", packed, scales)
    lead = weight.shape[:-1]
    return torch.from_numpy(packed).reshape(*lead, -1), torch.from_numpy(scales).reshape(*lead, -1)
