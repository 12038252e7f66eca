"""The one checked writer for every file a run writes: atomic replacement, appends, safetensors, and a full disk.

A write that fails for lack of space (``ENOSPC``), a quota (``EDQUOT``) or a file-size limit (``EFBIG``: with
``SIGXFSZ`` ignored, as CPython and the CLI set it, such a write fails instead of killing the process) raises
:class:`DiskFullError`, which the CLI prints as one line with exit code 2. Nothing that fails that way removes a
run's partial work (the hidden ``.OUT.run`` and ``.OUT.incomplete`` directories), so ``--resume`` continues once
there is room; a failed atomic write removes only its own temporary file, which gives the space back. Every byte
goes through :func:`write_chunk`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_REASONS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file-size limit reached",
}


class DiskFullError(Exception):
    """A write failed for lack of space, a quota or a file-size limit.

    Not a :class:`~moecompress.errors.UserInputError` on purpose: the handlers that remove a failed run's work
    directories on bad input must let this one pass, so that ``--resume`` continues once there is room. The CLI
    prints one line (with the command that continues) and exits with code 2.
    """

    def __init__(self, path: str, code: int | None, needed: int | None = None):
        self.path, self.code, self.needed = path, code, needed
        more = "" if not needed else f" (at least {_human(needed)} more needed)"
        super().__init__(f"{_REASONS.get(code, _REASONS[errno.ENOSPC])} writing {path}{more}")

    def writing(self, path: str) -> DiskFullError:
        """The same failure named by ``path`` (the output the user asked for rather than a hidden file in it)."""
        return DiskFullError(str(path), self.code, self.needed)


def _human(count: int) -> str:
    if count < 1024:
        return f"{count} bytes"
    size, unit = count / 1024, "KiB"
    for larger in ("MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, larger
    return f"{size:.1f} {unit}"


def is_full(error: BaseException) -> bool:
    """Whether ``error`` is a write that failed for space, a quota or a file-size limit."""
    return isinstance(error, OSError) and error.errno in FULL_ERRNOS


def write_chunk(handle: BinaryIO, data: Any) -> None:
    """Write all of the buffer ``data`` to the unbuffered ``handle`` (a short write is continued)."""
    view = memoryview(data).cast("B")
    while view:
        count = handle.write(view)
        view = view[count:]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], size: int | None = None) -> Iterator[BinaryIO]:
    """An unbuffered handle on a temporary sibling of ``path`` that replaces ``path`` in one step when the block
    ends; on any failure the temporary file is removed. ``size`` (the bytes the block writes, when known) lets a
    full disk say how much more was needed."""
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb", buffering=0) as handle:
            yield handle
        os.replace(temporary, path)
    except OSError as error:
        needed = None if size is None else max(size - _size(temporary), 0)
        temporary.unlink(missing_ok=True)
        if is_full(error):
            raise DiskFullError(str(path), error.errno, needed) from error
        raise
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def appending(path: str | os.PathLike[str], size: int | None = None, *, sync: bool = False) -> Iterator[BinaryIO]:
    """An unbuffered handle appending to ``path``, flushed to the disk at the end with ``sync``. A full disk says
    how much of ``size`` was still unwritten; what did get appended stays (journalled readers cut it off)."""
    path = Path(path)
    start = None
    try:
        with open(path, "ab", buffering=0) as handle:
            start = handle.tell()
            yield handle
            if sync:
                os.fsync(handle.fileno())
    except OSError as error:
        if not is_full(error):
            raise
        needed = None if size is None or start is None else max(size - (_size(path) - start), 0)
        raise DiskFullError(str(path), error.errno, needed) from error


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with replacing(path, len(data)) as handle:
        write_chunk(handle, data)


def write_text(path: str | os.PathLike[str], text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: str | os.PathLike[str], content: Any, *, indent: int | None = 2) -> None:
    """``content`` as JSON with a final newline (on one line when ``indent`` is None)."""
    write_text(path, json.dumps(content, indent=indent) + "\n")


def tensor_bytes(tensor: Any) -> memoryview:
    """The tensor's bytes (a copy only if it is not a contiguous CPU tensor)."""
    import torch

    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data


def write_safetensors(path: str | os.PathLike[str], tensors: dict[str, Any], metadata: dict[str, str]) -> None:
    """A safetensors file of ``tensors`` (in order) with ``metadata``, streamed tensor by tensor and atomic.

    Tensors that share storage (one result under two names) are written as separate copies."""
    from .checkpoint.reader import SAFETENSORS_DTYPES

    table: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        table[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape)}
        table[name]["data_offsets"] = [offset, offset + nbytes]
        offset += nbytes
    header = json.dumps(table, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    prefix = len(header).to_bytes(8, "little") + header
    with replacing(path, len(prefix) + offset) as handle:
        write_chunk(handle, prefix)
        for tensor in tensors.values():
            write_chunk(handle, tensor_bytes(tensor))
