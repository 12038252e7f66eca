"""The registered input decoders (how a quantised release's stored tensors are read as bf16); importing this package
registers the built-in ones, one line each."""

# isort: off
from . import fp8  # noqa: F401
from . import mxfp4  # noqa: F401
from . import compressed_tensors  # noqa: F401

# isort: on
from .base import INPUT_DECODERS, Encoded, InputDecoder, InputFormat, register, unregister

__all__ = ["INPUT_DECODERS", "Encoded", "InputDecoder", "InputFormat", "register", "unregister"]
