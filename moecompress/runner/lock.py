"""One writer at a time per output directory.

A run holds ``fcntl.flock`` on ``.OUT.lock`` beside ``--out`` (not inside the hidden ``.OUT.run``, which a
``--restart`` removes and recreates) from its output checks to its end. A second run on the same ``--out``, or a
``--resume`` of a run still going, finds the lock taken and is refused with the holder's pid and command line,
which the holder writes into the file. The kernel drops the lock when its holder dies, so a killed run never
blocks ``--resume`` or ``--restart``; the file it leaves is reused. The holder removes the file when it ends; the
inode check on taking the lock makes that removal safe against a run that opened the file just before it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from ..errors import OptionError

_held: dict[Path, tuple[int, list[Path]]] = {}
"""This process's locks: output directory -> (descriptor, parent directories made for the lock file)."""


def lock_path(out_dir: str | os.PathLike[str]) -> Path:
    from ..checkpoint.writer import hidden_dir

    return hidden_dir(Path(out_dir).absolute(), "lock")


def _command() -> str:
    """This process's command line as a user would recognise it: ``moecompress ARGS``, ``python SCRIPT ARGS``."""
    first = sys.argv[0] if sys.argv else ""
    if Path(first).name == "moecompress" or first.endswith(os.path.join("moecompress", "cli", "main.py")):
        name = "moecompress"
    else:
        name = "python " + (first if first in ("-c", "-m", "") else Path(first).name)
    text = " ".join([name.rstrip(), *sys.argv[1:]])
    return text if len(text) <= 200 else text[:197] + "..."


def _holder(descriptor: int) -> str:
    """What the holder wrote: ``pid N: COMMAND``, or that it is unknown (a holder that has not written yet)."""
    text = os.pread(descriptor, 4096, 0).decode(errors="replace")
    pid, _, command = text.partition("\n")
    if not pid.strip().isdigit():
        return "pid unknown"
    command = command.strip()
    return f"pid {pid.strip()}" + (f": {command}" if command else "")


def _made_parents(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing ancestors; the ones created, innermost first."""
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        path.mkdir(exist_ok=True)
    return missing


def acquire(out_dir: str | os.PathLike[str], *, label: str | None = None) -> None:
    """Take the lock on ``out_dir`` for this process (again: nothing to do), or refuse naming its holder.
    ``label`` begins the refusal (a :func:`~moecompress.vocabulary.named` ``run.out``, as each caller spells it)."""
    out_dir = Path(out_dir).absolute()
    if out_dir in _held:
        return
    path = lock_path(out_dir)
    try:
        made = _made_parents(path.parent)
    except OSError as error:
        raise OptionError(f"{label or out_dir}: cannot write in {error.filename} ({error.strerror})") from None
    while True:
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            _remove_empty(made)
            raise OptionError(f"{label or out_dir}: cannot write in {path.parent} ({error.strerror})") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(descriptor)
            os.close(descriptor)
            _remove_empty(made)
            raise OptionError(
                f"{label or out_dir}: another moecompress run ({holder}) is writing this output; "
                "wait for it to end (or stop it) before starting or resuming a run here"
            ) from None
        opened = os.fstat(descriptor)
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
            break
        os.close(descriptor)
    holder = f"{os.getpid()}\n{_command()}\n".encode()
    os.pwrite(descriptor, holder, 0)
    os.ftruncate(descriptor, len(holder))
    _held[out_dir] = (descriptor, made)


def release(out_dir: str | os.PathLike[str]) -> None:
    """Give the lock on ``out_dir`` back and remove its file (nothing if this process does not hold it)."""
    out_dir = Path(out_dir).absolute()
    held = _held.pop(out_dir, None)
    if held is None:
        return
    descriptor, made = held
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock_path(out_dir))
    os.close(descriptor)
    _remove_empty(made)


def _remove_empty(directories: list[Path]) -> None:
    for directory in directories:
        try:
            directory.rmdir()
        except OSError:
            return


@contextlib.contextmanager
def releasing(out_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Whatever happens inside, the lock on ``out_dir`` is released at the end (if this process took it)."""
    try:
        yield
    finally:
        release(out_dir)
