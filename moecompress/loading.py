"""Load a model directory with the family's transformers auto class, and its tokenizer. Remote code and pickle
weights only with the user's consent (:mod:`moecompress.trust`)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from . import trust
from .checkpoint import CheckpointReader
from .errors import UserInputError
from .families import FamilyAdapter, adapter_for


def quiet_transformers() -> None:
    """Silence transformers' per-load progress bars and its warning about token streams longer than the
    model's context (moecompress cuts streams into windows itself)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_adapter(directory: Path) -> FamilyAdapter:
    """The family adapter of a model directory, validating its weights' headers on the way."""
    with CheckpointReader(directory) as reader:
        return adapter_for(reader.config, source=str(directory))


def load_model(
    directory: Path,
    adapter: FamilyAdapter,
    dtype: torch.dtype = torch.float32,
    device_map: str | dict[str, str] | None = None,
) -> torch.nn.Module:
    """The model in eval mode, built by the family's transformers auto class; ``device_map="auto"`` spreads it
    over the GPUs (and CPU) with accelerate."""
    import transformers

    auto_class = getattr(transformers, adapter.auto_class)
    config = adapter.transformers_config()
    host = torch.device("cpu") if device_map is None else contextlib.nullcontext()  # not a default meta device
    try:
        with host:
            model = auto_class.from_pretrained(
                directory,
                **({} if config is None else {"config": config}),
                dtype=dtype,
                device_map=device_map,
                trust_remote_code=trust.CURRENT.remote_code,
                use_safetensors=None if trust.CURRENT.pickle else True,
            )
    except (ValueError, RuntimeError, KeyError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserInputError(f"{directory}: cannot load the model: {reason}") from error
    return model.eval()


def load_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, trust_remote_code=trust.CURRENT.remote_code)
    except (OSError, ValueError) as error:
        raise UserInputError(f"{directory}: no usable tokenizer ({str(error).splitlines()[0]})") from None
