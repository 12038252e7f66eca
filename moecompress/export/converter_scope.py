"""llama.cpp's converter run inside our process, with its own modules: its ``gguf`` (which may differ from the
installed one we use), ``conversion`` and ``convert_hf_to_gguf`` are swapped in for the call and out after it, so
that nothing of theirs stays behind and ours come back.

What the converter changes of the process is put back too: ``sys.path``, ``sys.argv``, the environment, the root
logger's handlers and level (its ``logging.basicConfig`` meets a handler of ours, which keeps its output), and
``sys.stdout``/``sys.stderr`` (its progress bars and prints are kept, not shown). Swapping ``sys.modules`` is not
safe while another thread may import: :func:`usable` says no where another thread runs, and the caller runs the
converter in a process of its own.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

THEIR_PACKAGES = ("gguf", "conversion", "convert_hf_to_gguf")


class ImportFailed(Exception):
    """The converter's modules could not be imported in this process."""


def usable() -> bool:
    """No thread but this one and tqdm's monitor (which only refreshes progress bars) is running."""
    others = [thread for thread in threading.enumerate() if thread is not threading.current_thread()]
    return all(type(thread).__module__ == "tqdm._monitor" for thread in others)


def _theirs(name: str) -> bool:
    return name.split(".")[0] in THEIR_PACKAGES


def _from(module: object, root: Path) -> bool:
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and Path(path).is_relative_to(root)


def _holds_theirs(module: ModuleType, root: Path) -> bool:
    """Whether a module imported during the call keeps one of the converter's modules or objects."""
    for value in list(vars(module).values()):
        if isinstance(value, ModuleType):
            if _from(value, root):
                return True
            continue
        try:
            home = getattr(value, "__module__", None)
        except Exception:  # objects may compute attributes; such an object is not one of the converter's
            continue
        if isinstance(home, str) and _theirs(home):
            return True
    return False


@contextlib.contextmanager
def converter_modules(root: Path) -> Iterator[io.StringIO]:
    """The converter's directory ``root`` and its ``gguf-py`` first on ``sys.path`` and none of our modules of
    their names imported; yields what the converter writes (output and log records)."""
    root = Path(root).resolve()
    ours = {name: module for name, module in sys.modules.items() if _theirs(name)}
    saved_path, saved_argv, saved_env = list(sys.path), list(sys.argv), dict(os.environ)
    logger = logging.getLogger()
    saved_handlers, saved_level = list(logger.handlers), logger.level
    output = io.StringIO()
    handler = logging.StreamHandler(output)
    for name in ours:
        del sys.modules[name]
    before = set(sys.modules)
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    logger.handlers = [handler]
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            yield output
    finally:
        added = [name for name in sys.modules if name not in before]
        for name in added:
            module = sys.modules.get(name)
            if _theirs(name) or _from(module, root) or (isinstance(module, ModuleType) and _holds_theirs(module, root)):
                del sys.modules[name]
        sys.modules.update(ours)
        sys.path[:], sys.argv[:] = saved_path, saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        logger.handlers, logger.level = saved_handlers, saved_level


def run(root: Path, spec: dict, args: list[str]) -> dict:
    """:func:`.convert_driver.convert` in this process; :class:`ImportFailed` where the converter's modules do not
    import here (the caller then runs it in a process of its own). The converter's own failures (an exception or
    ``sys.exit``) are raised as :class:`RuntimeError` with its last line of output."""
    from . import convert_driver

    with converter_modules(root) as output:
        os.environ["HF_HUB_OFFLINE"] = "1"
        try:
            import conversion  # noqa: F401
            import convert_hf_to_gguf  # noqa: F401
            import gguf  # noqa: F401
        except Exception as error:
            raise ImportFailed(f"{type(error).__name__}: {error}") from error
        try:
            return convert_driver.convert(spec, args)
        except (Exception, SystemExit) as error:
            lines = [line.strip() for line in output.getvalue().splitlines() if line.strip()]
            if not isinstance(error, SystemExit):
                lines.append(f"{type(error).__name__}: {error}")
            raise RuntimeError(lines[-1] if lines else f"exit code {error}") from error
