"""Apply per-sample head gates to a loaded transformers model without changing its weights.

A query head's gate multiplies its slice of the attention output before ``o_proj``; closing every query head of
a KV group removes the group's keys and values from the computation as well. Norms that span the whole q or k
projection (OLMoE) are recomputed over the open heads only, which is what the physically sliced model computes.
"""

from __future__ import annotations

import torch

from ..families import FamilyAdapter
from .layout import HeadLayout


def _masked_rms_norm(norm: torch.nn.Module, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``norm``'s RMS normalisation with the mean taken over the dimensions where ``keep`` is 1."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    count = keep.sum(-1, keepdim=True).clamp_min(1)
    variance = (x32.pow(2) * keep).sum(-1, keepdim=True) / count
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    return norm.weight * (x32 * torch.rsqrt(variance + eps)).to(dtype)


class GateMasks:
    """Hooks on every layer's attention; :meth:`set` gives the gates of the next forward passes.

    Gates are per layer ``[batch, units]`` (or ``[units]`` for the whole batch); ``None`` disables gating.
    """

    def __init__(self, model: torch.nn.Module, adapter: FamilyAdapter, layouts: list[HeadLayout]):
        self.layouts = layouts
        self.gates: list[torch.Tensor] | None = None
        self._handles = []
        for layer, layout in enumerate(layouts):
            attention = adapter.attention_of(model, layer)
            self._handles.append(attention.o_proj.register_forward_pre_hook(self._output_hook(layer)))
            if adapter.qk_norm == "per_projection":
                for name, heads in (("q_norm", layout.query_mask), ("k_norm", layout.kv_mask)):
                    norm = getattr(attention, name)
                    self._handles.append(norm.register_forward_hook(self._norm_hook(layer, heads)))

    def set(self, gates: list[torch.Tensor] | None) -> None:
        self.gates = gates

    def _dims(self, layer: int, per_head) -> torch.Tensor:
        gates = self.gates[layer]
        if gates.ndim == 1:
            gates = gates[None]
        return per_head(gates).repeat_interleave(self.layouts[layer].head_dim, dim=-1)[:, None, :]

    def _output_hook(self, layer: int):
        def hook(module, args):
            if self.gates is None:
                return None
            return (args[0] * self._dims(layer, self.layouts[layer].query_mask).to(args[0].dtype), *args[1:])

        return hook

    def _norm_hook(self, layer: int, per_head):
        def hook(module, args, output):
            if self.gates is None:
                return None
            keep = (self._dims(layer, per_head).detach() > 0.5).to(torch.float32)
            return _masked_rms_norm(module, args[0], keep)

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> GateMasks:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
