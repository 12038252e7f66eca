"""Quantised releases decoded on read: :func:`plan_decoding` asks the decoder registered for the checkpoint's
``quantization_config.quant_method`` (:mod:`moecompress.checkpoint.decoders`: ``fp8``, ``mxfp4``,
``compressed-tensors``) which raw tensors make up each logical weight and how to decode them; the reader then
presents the logical key with the decoded values, so passes see a bf16 checkpoint.

A checkpoint written by moecompress in its native format (``quant_method: moecompress``) is not decoded here:
:func:`native_refusal` names it so that prune and quantize can refuse it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UserInputError
from .decoders import INPUT_DECODERS, InputFormat
from .decoders.base import ReadSmall, Shapes

NATIVE_METHOD = "moecompress"


def quant_method(config: dict[str, Any]) -> str | None:
    """The config's ``quantization_config.quant_method`` (top level or in the text config)."""
    sections = [config, *(v for v in config.values() if isinstance(v, dict))]
    for section in sections:
        method = (section.get("quantization_config") or {}).get("quant_method")
        if method:
            return str(method)
    return None


def quantization_config(config: dict[str, Any]) -> dict[str, Any]:
    sections = [config, *(v for v in config.values() if isinstance(v, dict))]
    return next((s["quantization_config"] for s in sections if s.get("quantization_config")), {})


def target_dtype(config: dict[str, Any]) -> torch.dtype:
    """The dtype a quantised release dequantises to: its config's ``dtype``/``torch_dtype`` (bf16 if unset)."""
    sections = [config, *(v for v in config.values() if isinstance(v, dict))]
    for section in sections:
        name = section.get("dtype") or section.get("torch_dtype")
        if isinstance(name, str) and name in ("bfloat16", "float16", "float32"):
            return getattr(torch, name)
    return torch.bfloat16


def native_refusal(config: dict[str, Any], source: str) -> None:
    """A :class:`UserInputError` for a checkpoint moecompress wrote in its native quantised format."""
    if quant_method(config) == NATIVE_METHOD:
        raise UserInputError(f"{source}: already quantised by moecompress (native format); use the original checkpoint")


def _written_here(method: str) -> bool:
    """Whether ``method`` is that of a registered output format (the native one among them): a checkpoint in a
    format of ours that no decoder reads is read as stored."""
    from ..quantization.formats import OUTPUT_FORMATS

    return any(layout.quant_method == method for layout in OUTPUT_FORMATS.values())


def plan_decoding(config: dict[str, Any], shapes: Shapes, read_small: ReadSmall) -> InputFormat | None:
    """The decoding plan of a checkpoint (``shapes``: raw key → (shape, safetensors dtype name); ``read_small``
    reads a small raw tensor such as ``weight_shape``), or None for a plain one (no ``quantization_config``, or
    one in an output format of ours that no decoder reads, such as the native one, which the plugin reads)."""
    method = quant_method(config)
    decoder = INPUT_DECODERS.get(method)
    if method is None or (decoder is None and _written_here(method)):
        return None
    if decoder is None:
        raise UserInputError(
            f"quantization_config.quant_method {method!r} is not a layout moecompress reads "
            f"({', '.join(INPUT_DECODERS)}); start from the bf16 release"
        )
    return decoder.plan(quantization_config(config), shapes, target_dtype(config), read_small)


def describe_input(model_dir) -> dict[str, Any]:
    """What a checkpoint's weights are stored as, for a pass's report."""
    from .reader import CheckpointReader

    with CheckpointReader(model_dir) as reader:
        found = reader.input_format
        if found is None:
            return {"format": "unquantised", "description": "floating-point weights as stored"}
        return {"format": found.name, "description": found.description, "decoded_to": str(target_dtype(reader.config))}
