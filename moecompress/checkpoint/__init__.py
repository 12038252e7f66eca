"""Checkpoint IO: resolve a model name, read shards lazily, write shards atomically, group keys by layer."""

from .reader import CheckpointReader, TensorInfo, read_safetensors_header
from .resolve import BUILTIN_MODELS, resolve_model
from .stream import group_keys_by_layer
from .writer import INCOMPLETE_MARKER, CheckpointWriter

__all__ = [
    "BUILTIN_MODELS",
    "INCOMPLETE_MARKER",
    "CheckpointReader",
    "CheckpointWriter",
    "TensorInfo",
    "group_keys_by_layer",
    "read_safetensors_header",
    "resolve_model",
]
