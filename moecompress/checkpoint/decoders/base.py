"""What an input decoder is: an :class:`InputDecoder` subclass registered under the ``quant_method`` of the
releases it reads, which maps each logical key of such a checkpoint (the name the weight has in the bf16 release) to
an :class:`Encoded` naming the raw tensors that store it and how to decode them. The reader asks the registry
(:func:`moecompress.checkpoint.decode.plan_decoding`) and presents the decoded values, so passes see a bf16
checkpoint; nothing else compares a ``quant_method``.

Adding a decoder is one module with a :func:`register`-decorated subclass and one import line in
:mod:`moecompress.checkpoint.decoders`; a decoder defined elsewhere (a test, a user's script) registers the same
way before the checkpoint is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ...registry import Registry

Decoder = Callable[[dict[str, torch.Tensor]], torch.Tensor]
Shapes = dict[str, tuple[tuple[int, ...], str]]
"""Raw key → (shape, safetensors dtype name)."""
ReadSmall = Callable[[str], torch.Tensor]
"""Reads a small raw tensor (such as compressed-tensors' ``weight_shape``) while planning."""

ACTIVATION_SUFFIXES = ("input_scale", "input_global_scale", "activation_scale", "output_scale", "k_scale", "v_scale")
"""Static activation scales: neither decoded nor passed through."""

INPUT_DECODERS: Registry[InputDecoder] = Registry("input decoder", key="quant_method")


@dataclass(frozen=True)
class Encoded:
    """One logical weight stored as ``parts`` (raw keys, the codes first), decoded to ``shape`` by ``decode``
    (which gets the parts by their suffix after the logical key's module, e.g. ``weight_scale_inv``)."""

    parts: dict[str, str]
    shape: tuple[int, ...]
    decode: Decoder


@dataclass(frozen=True)
class InputFormat:
    """What a checkpoint's weights are stored as: ``name`` for reports, and the decoding plan."""

    name: str
    description: str
    encoded: dict[str, Encoded]
    dropped: frozenset[str]
    """Raw keys that are neither decoded nor passed through (static activation scales)."""

    @property
    def raw_keys(self) -> set[str]:
        return {key for enc in self.encoded.values() for key in enc.parts.values()} | set(self.dropped)


class InputDecoder:
    """The decoding of one ``quant_method``."""

    quant_method: ClassVar[str]

    def plan(self, qconfig: dict[str, Any], shapes: Shapes, dtype: torch.dtype, read_small: ReadSmall) -> InputFormat:
        """The decoding plan of a checkpoint whose ``quantization_config`` is ``qconfig``, decoding to ``dtype``;
        raise :class:`~moecompress.errors.UserInputError` for what it stores but this decoder cannot read."""
        raise NotImplementedError


register = INPUT_DECODERS.register
unregister = INPUT_DECODERS.unregister
