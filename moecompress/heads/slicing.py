"""Physically remove heads from one layer's attention tensors (on-disk or runtime names, relative to the
attention module): q/k/v rows and biases, o_proj columns, and q/k norms when they span the whole projection."""

from __future__ import annotations

import torch

from ..families.base import QKNorm
from .layout import HeadLayout

_QUERY_ROWS = ("q_proj.weight", "q_proj.bias")
_KV_ROWS = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
_UNCHANGED = ("o_proj.bias",)


def slice_attention(
    tensors: dict[str, torch.Tensor], layout: HeadLayout, keep_units: list[int], qk_norm: QKNorm
) -> dict[str, torch.Tensor]:
    """The tensors of the attention module with only the heads of ``keep_units`` left."""
    queries, kv_heads = layout.kept_heads(keep_units)
    device = next(iter(tensors.values())).device
    query_rows, kv_rows = layout.rows(queries, device), layout.rows(kv_heads, device)
    out = {}
    for name, tensor in tensors.items():
        if name in _QUERY_ROWS:
            out[name] = tensor.index_select(0, query_rows)
        elif name in _KV_ROWS:
            out[name] = tensor.index_select(0, kv_rows)
        elif name == "o_proj.weight":
            out[name] = tensor.index_select(1, query_rows)
        elif name in ("q_norm.weight", "k_norm.weight"):
            rows = query_rows if name.startswith("q") else kv_rows
            out[name] = tensor.index_select(0, rows) if qk_norm == "per_projection" else tensor
        elif name in _UNCHANGED:
            out[name] = tensor
        else:
            raise ValueError(f"attention tensor {name!r} is not one head pruning knows how to slice")
        out[name] = out[name].contiguous()
    return out
