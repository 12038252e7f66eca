"""How long work shows itself: a bar on a terminal, timestamped lines elsewhere (CI logs), JSON lines for
machines, or nothing.

Library code wraps its loops in :func:`bar` and announces milestones with :func:`event`; the command line picks
the :data:`MODE` once (``--quiet``, ``--log-json``, or by whether stderr is a terminal). Everything goes to
stderr, so stdout keeps only the results (the summary table).
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from typing import Any, Literal, TypeVar

from tqdm.auto import tqdm

Mode = Literal["auto", "bars", "lines", "json", "quiet"]
MODE: Mode = "auto"
"""``auto``: bars on a terminal, lines otherwise. Set by the CLI (:func:`configure`)."""
LINE_INTERVAL_S = 10.0
"""Plain and JSON modes report a loop at its start, at most this often while it runs, and at its end."""

Item = TypeVar("Item")


def configure(*, quiet: bool = False, log_json: bool = False) -> None:
    global MODE
    MODE = "quiet" if quiet else "json" if log_json else "auto"


@contextlib.contextmanager
def silenced(silent: bool = True) -> Iterator[None]:
    """No events or bars inside the block when ``silent`` (the Python API's ``progress=False``); the mode the
    caller had is restored afterwards."""
    global MODE
    saved = MODE
    if silent:
        MODE = "quiet"
    try:
        yield
    finally:
        MODE = saved


def _mode() -> Mode:
    if MODE != "auto":
        return MODE
    return "bars" if sys.stderr.isatty() else "lines"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


HOLD_S = LINE_INTERVAL_S
"""Plain-line mode holds "started" lines at most this long (a timer prints them then): quick work, and a failure
found early (whose one-line error should stand alone), print nothing they do not need, and slow work shows its
start lines at the cadence of a running loop's lines, not only when its first step ends."""
_held: list[str] = []
_lock = threading.Lock()
_timer: threading.Timer | None = None


def _flush_held() -> None:
    with _lock:
        for held in _held:
            print(held, file=sys.stderr)
        _held.clear()
        sys.stderr.flush()


def _hold(line: str) -> None:
    global _timer
    with _lock:
        first = not _held
        _held.append(line)
        if first or _timer is None or not _timer.is_alive():
            # The hold counts from the oldest line held: a timer left from lines already printed or dropped would
            # print this one late.
            if _timer is not None:
                _timer.cancel()
            _timer = threading.Timer(HOLD_S, _flush_held)
            _timer.daemon = True
            _timer.start()


def _drop_held(line: str | None = None) -> bool:
    """Forget held lines (``line`` alone, when given) that the work they announced made needless; False when
    ``line`` was no longer held (it was printed)."""
    with _lock:
        if line is None:
            _held.clear()
            return True
        if line in _held:
            _held.remove(line)
            return True
        return False


def end_of_command() -> None:
    """Forget the lines still held when a command ends (it failed early, or its work never reported): in a process
    that runs several commands (a notebook, a test run) they would otherwise be printed late, or delay the next
    command's own start lines until their timer fired."""
    global _timer
    with _lock:
        _held.clear()
        if _timer is not None:
            _timer.cancel()
            _timer = None


def _emit(record: dict[str, Any], text: str, *, hold: bool = False) -> str:
    if _mode() == "json":
        print(json.dumps({"time": _now(), **record}), file=sys.stderr, flush=True)
        return ""
    line = f"{_now()} {text}"
    if hold:
        _hold(line)
        return line
    _flush_held()
    print(line, file=sys.stderr, flush=True)
    return line


def event(kind: str, message: str, *, starting: bool = False, only_json: bool = False, **fields: Any) -> None:
    """A milestone (a pass starting or ending, a resumed state found): one line, or one JSON object.
    ``starting`` lines are held back in plain-line mode until a slow loop reports (see :data:`_held`);
    ``only_json`` ones are for machines (what the text output already shows otherwise)."""
    if _mode() == "quiet" or (only_json and _mode() != "json"):
        return
    if not starting:
        _drop_held()
    _emit({"event": kind, "message": message, **fields}, message, hold=starting)


def warn(message: str) -> None:
    """Something the user should know that is not an error (a replaced character, a fallback): one line on stderr,
    or one JSON object with --log-json; shown under --quiet too."""
    if _mode() == "json":
        print(json.dumps({"time": _now(), "event": "warning", "message": message}), file=sys.stderr, flush=True)
        return
    _flush_held()
    print(f"moecompress: warning: {message}", file=sys.stderr, flush=True)


def bar(
    iterable: Iterable[Item],
    *,
    desc: str,
    unit: str,
    total: int | None = None,
    initial: int = 0,
    disable: bool = False,
) -> Iterator[Item]:
    """``iterable``, shown as ``desc`` progresses; ``disable`` (a library caller's ``progress=False``) hides it."""
    mode = _mode()
    if disable or mode == "quiet":
        yield from iterable
        return
    if total is None and hasattr(iterable, "__len__"):
        total = initial + len(iterable)  # type: ignore[arg-type]
    if mode == "bars":
        yield from tqdm(iterable, desc=desc, unit=unit, total=total, initial=initial)
        return
    yield from _lines(iterable, desc, unit, total, initial)


def _lines(iterable: Iterable[Item], desc: str, unit: str, total: int | None, initial: int) -> Iterator[Item]:
    started = last = time.monotonic()
    done = initial
    shown = False
    shown_done = -1
    start_line = ""

    def report(state: str) -> str:
        nonlocal shown, shown_done
        elapsed = time.monotonic() - started
        of = f"/{total}" if total is not None else ""
        percent = f" ({100 * done / total:.0f}%)" if total else ""
        line = _emit(
            {
                "event": "progress",
                "task": desc,
                "state": state,
                "done": done,
                "total": total,
                "unit": unit,
                "elapsed_s": round(elapsed, 1),
            },
            f"{desc}: {done}{of} {unit}{percent}, {elapsed:.1f}s"
            + (" (resumed)" if state == "start" and initial else ""),
            hold=state == "start",
        )
        shown = shown or state == "running"
        if state == "running":
            shown_done = done
        return line

    start_line = report("start")
    for item in iterable:
        yield item
        done += 1
        if time.monotonic() - last >= LINE_INTERVAL_S:
            last = time.monotonic()
            report("running")
    if _mode() == "json":
        report("end")
    elif shown_done == done:
        return  # the last running line already says it
    elif shown or not _drop_held(start_line):
        report("end")
