"""The stock transformers config and model built from a checkpoint's ``config.json``, with the failures of
transformers itself (a config value its classes reject, a model its code cannot build) turned into one line naming
the checkpoint, instead of a traceback. Failures raised in moecompress's own code are left as they are."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from huggingface_hub.errors import StrictDataclassError

from ..errors import UserInputError

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
_STOCK_FAILURES = (
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    NotImplementedError,
    RuntimeError,
    ZeroDivisionError,
    AssertionError,
    StrictDataclassError,
)
"""What transformers' config and modeling code raise on values it cannot use (a missing table entry, a failed
validation of a config field, a shape it cannot make)."""


def _raised_in_moecompress(error: BaseException) -> bool:
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    return traceback is not None and traceback.tb_frame.f_code.co_filename.startswith(_PACKAGE_ROOT)


def _reason(error: BaseException) -> str:
    """The innermost cause's type and first line (transformers' validation wraps the message it means)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _raised_where(error: BaseException) -> str:
    traceback = error.__traceback__
    while traceback is not None and traceback.tb_next is not None:
        traceback = traceback.tb_next
    if traceback is None:
        return ""
    path = Path(traceback.tb_frame.f_code.co_filename)
    parts = path.parts
    package = next((i for i, part in enumerate(parts) if part in ("transformers", "huggingface_hub", "torch")), None)
    return "" if package is None else f" (raised in {'/'.join(parts[package:])})"


@contextlib.contextmanager
def stock_failures(model_dir: Path | str, what: str) -> Iterator[None]:
    """Inside, an error raised by transformers (or the libraries it calls) becomes ``UserInputError``: "MODEL:
    stock transformers cannot WHAT: REASON"."""
    try:
        yield
    except UserInputError:
        raise
    except _STOCK_FAILURES as error:
        if _raised_in_moecompress(error):
            raise
        import transformers

        raise UserInputError(
            f"{model_dir}: stock transformers {transformers.__version__} cannot {what}: "
            f"{_reason(error)}{_raised_where(error)}"
        ) from error


def stock_config(model_dir: Path | str, adapter: Any) -> Any:
    """The transformers config object the model is built from (the adapter's, else ``config.json`` read by
    transformers, no remote code)."""
    import transformers

    with stock_failures(model_dir, "read config.json"):
        config = adapter.transformers_config()
        return config or transformers.AutoConfig.from_pretrained(model_dir, trust_remote_code=False)


def check_stock_model_builds(model_dir: Path | str, adapter: Any) -> None:
    """Build the model on the meta device (no memory, no weights read), so that a config stock transformers cannot
    build is refused before any calibration or evaluation work."""
    import torch
    import transformers

    config = stock_config(model_dir, adapter)
    auto_class = getattr(transformers, adapter.auto_class)
    with stock_failures(model_dir, f"build the {adapter.family} model from config.json"), torch.device("meta"):
        auto_class.from_config(config, attn_implementation="eager")  # moecompress picks the attention itself
