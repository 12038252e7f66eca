"""How a run the CLI started ends early: SIGINT/SIGTERM and a full disk each end in one line that says what was kept
and gives the command that continues (the same command with ``--resume``).

SIGINT and SIGTERM raise :class:`Interrupted` in the main thread; it is a ``BaseException``, so the handlers that
remove a failed run's work directories on bad input let it pass and the partial work stays. The exit code is
128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell reports a process the signal ended. A second
signal of either kind ends the process at once. ``SIGXFSZ`` is ignored (CPython does so at startup; this holds it
for a host that does not), so that a write past a file-size limit (``ulimit -f``) fails with ``EFBIG`` and is
reported like a full disk instead of killing the process.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import threading
from collections.abc import Iterator

import click

_STOPPING = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the CLI: the run stops where it is, its partial work stays."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _stop(signum: int, frame: object) -> None:
    for each in _STOPPING:
        signal.signal(each, signal.SIG_DFL)
    raise Interrupted(signum)


@contextlib.contextmanager
def handling_signals() -> Iterator[None]:
    """SIGINT/SIGTERM raise :class:`Interrupted` and SIGXFSZ is ignored inside the block (main thread only); the
    previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    names = [*_STOPPING, *([signal.SIGXFSZ] if hasattr(signal, "SIGXFSZ") else [])]
    previous = {signum: signal.getsignal(signum) for signum in names}
    for signum in _STOPPING:
        signal.signal(signum, _stop)
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _command(group: click.Group, argv: list[str]) -> click.Command | None:
    name = next((arg for arg in argv if not arg.startswith("-")), None)
    return group.commands.get(name) if name is not None else None


def resume_hint(group: click.Group, argv: list[str], first: str = "") -> str:
    """``; the partial work is kept: run `moecompress … --resume` to continue`` for a command that takes
    --resume (``first`` goes before "run"), else ''."""
    command = _command(group, argv)
    if command is None or not any(param.name == "resume" for param in command.params):
        return ""
    args = [arg for arg in argv if arg != "--restart"]
    if "--resume" not in args:
        args.append("--resume")
    ranks = int(os.environ.get("WORLD_SIZE", "1") or 1)
    alone = " in a single process (--resume refuses torchrun)" if ranks > 1 else ""
    return f"; the partial work is kept: {first}run `moecompress {shlex.join(args)}`{alone} to continue"


def interrupted_line(group: click.Group, argv: list[str], stop: Interrupted) -> str:
    return f"moecompress: interrupted by {signal.Signals(stop.signum).name}{resume_hint(group, argv)}"
