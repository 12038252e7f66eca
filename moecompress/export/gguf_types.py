"""Which GGUF tensors take a GGML block type, which types they may take, and what each costs in bytes.

The rule for *which* is llama.cpp's own (``tensor_allows_quantization`` in src/llama-quant.cpp of the llama.cpp that
llama-cpp-python 0.3.36 vendors): 2-D and larger ``*weight`` tensors except norms, routers (``ffn_gate_inp``),
positional and token-type embeddings, convolution and a list of small architecture-specific tensors, which stay as
the converter wrote them. A type whose block does not divide a tensor's row width takes the 32-wide type llama.cpp
falls back to (``tensor_type_fallback``); a width that is not a multiple of 32 keeps the converter's float type.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import OptionError
from ..vocabulary import named

KEPT_SUBSTRINGS = (
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "time_mix_",
    "attn_rel_b.weight",
    ".position_embd",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
)
KEPT_NAMES = ("position_embd.weight", "token_types.weight")

FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
"""llama.cpp's type for rows whose width is not a multiple of 256."""

CHOICES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
"""The types ``--target-size`` chooses among, smallest first."""

ENCODED = (*CHOICES, "Q4_0", "Q5_0", "Q5_1", "IQ4_NL")
"""Every type our encoders write (``--base-type``)."""
PINNABLE = (*ENCODED, "keep")
"""What ``--tensor-type`` may name: a GGML type we encode, or ``keep`` (as the converter wrote it)."""

FLOAT_TYPES = ("F32", "F16", "BF16")


def quantisable(name: str, n_dims: int) -> bool:
    """Whether llama-quantize would quantise the tensor ``name`` (a GGUF name)."""
    if n_dims < 2 or not name.endswith("weight") or name in KEPT_NAMES:
        return False
    return not any(part in name for part in KEPT_SUBSTRINGS)


def stored_type(type_name: str, cols: int) -> str | None:
    """The type a ``cols``-wide row of ``type_name`` is written in, or None where no block type fits."""
    from .ggml_blocks import BLOCKS

    block = BLOCKS[type_name][0]
    if cols % block == 0:
        return type_name
    fallback = FALLBACK.get(type_name)
    if fallback is not None and cols % BLOCKS[fallback][0] == 0:
        return fallback
    return None


def nbytes(type_name: str, shape: tuple[int, ...]) -> int:
    from .ggml_blocks import BLOCKS

    block, block_bytes = BLOCKS[type_name]
    return math.prod(shape[:-1]) * (shape[-1] // block) * block_bytes


@dataclass(frozen=True)
class Pin:
    """``--tensor-type PATTERN=TYPE``: GGUF tensor names matching ``pattern`` (a regular expression, searched)
    take ``type_name``."""

    pattern: re.Pattern[str]
    type_name: str

    def matches(self, name: str) -> bool:
        return self.pattern.search(name) is not None


def parse_pins(values: tuple[str, ...] | list[str]) -> list[Pin]:
    pins = []
    for value in values:
        pattern, sep, type_name = value.rpartition("=")
        if not sep or not pattern:
            raise OptionError(
                f"{named('tensor_type', value)}: expected PATTERN=TYPE, e.g. 'attn_v=Q6_K' or 'output=Q8_0'"
            )
        canonical = type_name if type_name == "keep" else type_name.upper()
        if canonical not in PINNABLE:
            raise OptionError(f"{named('tensor_type', value)}: type {type_name} is not one of {', '.join(PINNABLE)}")
        try:
            compiled = re.compile(pattern)
        except re.error as error:
            raise OptionError(
                f"{named('tensor_type', value)}: {pattern!r} is not a regular expression ({error})"
            ) from None
        pins.append(Pin(compiled, canonical))
    return pins


def pinned_type(pins: list[Pin], name: str) -> str | None:
    """The type of the first pin that matches ``name`` (pins are given most specific first, as llama-quantize's
    ``--tensor-type`` takes them)."""
    for pin in pins:
        if pin.matches(name):
            return pin.type_name
    return None


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?)[bB]?\s*$")


def parse_size(text: str) -> int:
    """``123456``, ``5.2MB`` (10^6), ``1.5GiB`` (2^30) → bytes."""
    match = _SIZE.match(str(text))
    if not match:
        raise OptionError(f"{named('target_size', text)}: expected bytes or a size such as 5.2MB or 17GiB")
    number, prefix, binary = match.groups()
    power = "kmgt".find(prefix.lower()) + 1 if prefix else 0
    value = float(number) * (1024 if binary else 1000) ** power
    if value < 1:
        raise OptionError(f"{named('target_size', text)}: must be at least one byte")
    return int(value)
