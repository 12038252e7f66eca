"""Dropping a checkpoint from the page cache, so that a benchmark's next run reads it from the disk."""

from __future__ import annotations

import os
from pathlib import Path


def drop_from_page_cache(directory: Path) -> None:
    """Drop ``directory``'s safetensors files from this system's page cache (their clean pages,
    ``POSIX_FADV_DONTNEED``), so that the next run reads the checkpoint as a first run does, not from what the run
    before it left cached."""
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
