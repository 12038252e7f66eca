"""Whether a floating-point tensor holds NaN or Inf, checked on its bits (numba): every weight read is checked,
so the check must cost about one pass over memory. A value is non-finite exactly when its exponent bits are
all ones."""

from __future__ import annotations

import numpy as np
import torch

from .numba_threads import torch_thread_count

try:
    import numba
except ImportError:  # pragma: no cover - exercised only where numba is missing
    numba = None

_EXPONENT_BITS = {
    torch.bfloat16: (torch.int16, np.uint16, 0x7F80),
    torch.float16: (torch.int16, np.uint16, 0x7C00),
    torch.float32: (torch.int32, np.uint32, 0x7F800000),
}

_CHUNK = 1 << 16

if numba is not None:

    @numba.njit(parallel=True, cache=True)
    def _count_non_finite(bits, mask):
        chunks = (bits.shape[0] + _CHUNK - 1) // _CHUNK
        found = np.zeros(chunks, np.int64)
        for chunk in numba.prange(chunks):
            count = 0
            for i in range(chunk * _CHUNK, min(bits.shape[0], (chunk + 1) * _CHUNK)):
                count += (bits[i] & mask) == mask
            found[chunk] = count
        return found.sum()


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no element of ``tensor`` (any floating dtype) is NaN or Inf."""
    layout = _EXPONENT_BITS.get(tensor.dtype)
    if numba is None or layout is None or tensor.numel() < _CHUNK:
        return bool(torch.isfinite(tensor).all())
    signed, unsigned, mask = layout
    bits = tensor.detach().contiguous().reshape(-1).view(signed).numpy().view(unsigned)
    with torch_thread_count():
        return int(_count_non_finite(bits, unsigned(mask))) == 0
