"""Load a model directory with the family's transformers auto class, and its tokenizer. Remote code and pickle
weights only with the user's consent (:mod:`moecompress.trust`)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from . import trust
from .checkpoint import CheckpointReader
from .checkpoint.consistency import check_against_config
from .errors import UserInputError
from .families import FamilyAdapter, adapter_for


def quiet_transformers() -> None:
    """Silence transformers' per-load progress bars and its warning about token streams longer than the
    model's context (moecompress cuts streams into windows itself)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_adapter(directory: Path) -> FamilyAdapter:
    """The family adapter of a model directory, validating its weights' headers, and config.json against them,
    on the way."""
    with CheckpointReader(directory) as reader:
        adapter = adapter_for(reader.config, source=str(directory))
        check_against_config(adapter, reader.tensors, str(directory))
        return adapter


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
    refuse_non_finite(model, directory)
    return model.eval()


def refuse_non_finite(model: torch.nn.Module, directory: Path) -> None:
    """Refuse a model whose weights hold NaN or Inf, naming the first such parameter. ``from_pretrained`` has just
    read every weight, so this is the read-time check the layer-by-layer paths make in
    :meth:`~moecompress.checkpoint.CheckpointReader.read`; without it a whole-model pass (head gates, QAT) would
    run to its end on NaN."""
    from .kernels.finite import all_finite

    for name, weight in model.named_parameters():
        if not weight.is_floating_point() or weight.element_size() < 2 or weight.device.type == "meta":
            continue
        finite = all_finite(weight) if weight.device.type == "cpu" else bool(torch.isfinite(weight).all())
        if not finite:
            raise UserInputError(f"{directory}: weight {name!r} holds NaN or Inf values")


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tiktoken.model",
    "tekken.json",
    "*.tiktoken",
    "*.model",
)
"""Files one of which every tokenizer transformers builds from a directory reads its vocabulary from."""


def check_tokenizer_files(directory: Path) -> None:
    """``directory`` holds a tokenizer's vocabulary (or names remote tokenizer code); without one transformers
    builds an empty tokenizer, whose zero tokens would be blamed on the data."""
    directory = Path(directory)
    if any(next(directory.glob(pattern), None) is not None for pattern in TOKENIZER_FILES):
        return
    config = directory / "tokenizer_config.json"
    if config.is_file() and "auto_map" in config.read_text(errors="replace"):
        return
    raise UserInputError(
        f"{directory}: no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json, ...); copy the base "
        "model's tokenizer files into it"
    )


def load_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    check_tokenizer_files(directory)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust.CURRENT.remote_code)
    except (OSError, ValueError) as error:
        raise UserInputError(f"{directory}: no usable tokenizer ({str(error).splitlines()[0]})") from None
    if not tokenizer("The tokenizer works.", add_special_tokens=False)["input_ids"]:
        raise UserInputError(f"{directory}: no usable tokenizer (it turns text into no tokens)")
    return tokenizer
