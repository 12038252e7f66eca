"""Give freed memory back to the operating system between layers.

Streaming allocates and frees one layer's worth of tensors per step. glibc's allocator keeps freed blocks below
its (adaptive) mmap threshold in the heap, so without a trim the resident size creeps up layer after layer
although nothing is alive. ``malloc_trim`` returns those pages; elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def release_freed_memory() -> None:
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
