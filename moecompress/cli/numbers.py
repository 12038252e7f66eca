"""Human-readable counts and sizes for command output."""

from __future__ import annotations


def human_int(value: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.2f}{unit}"
    return str(value)


def human_bytes(value: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} B"
