"""Numba's parallel kernels run with torch's thread count and leave torch's count as it was.

Numba's OpenMP threading layer shares libgomp with torch, and launching its pool sets the OpenMP thread count to
``NUMBA_NUM_THREADS`` (every core): without the restore, the first NaN check of a run started with
``OMP_NUM_THREADS=1`` would move every later torch reduction onto two threads and change its float rounding."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_thread_count() -> Iterator[None]:
    """Run numba kernels in this block on as many threads as torch uses, and give torch its count back."""
    import numba

    threads = torch.get_num_threads()
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
