"""Fused experts stored with their gate and up rows interleaved: ``mlp.experts.w13_weight`` ``[E, 2I, H]``, whose rows
alternate gate, up (transformers' ``Interleave``), and ``mlp.experts.w2_weight`` ``[E, H, I]`` (Inkling's and
Inkling 2's native names), read into and written from the canonical view (gate rows first)."""

from __future__ import annotations

import torch

from .base import Layout, MoEWeights


def interleaved_halves(tensor: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a ``w13`` tensor whose rows along ``dim`` alternate gate, up."""
    return tensor.unflatten(dim, (-1, 2)).unbind(dim + 1)


def interleaved(gate: torch.Tensor, up: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_halves`."""
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1).contiguous()


class InterleavedW13Experts:
    """Mixin, listed before the family's adapter class: every MoE layer's experts are stored so."""

    def detect_layout(self, layer: int, keys) -> Layout:
        if self._fused_key(layer, "w13_weight") in keys:
            return "fused"
        raise KeyError(f"layer {layer}: no expert tensors found under {self.layer_prefix(layer)}mlp.experts")

    def _pop_experts(self, layer: int, rest: dict[str, torch.Tensor], layout: Layout) -> MoEWeights:
        gate, up = interleaved_halves(rest.pop(self._fused_key(layer, "w13_weight")), 1)
        down = rest.pop(self._fused_key(layer, "w2_weight"))
        return MoEWeights(router_weight=torch.empty(0), gate_up=torch.cat([gate, up], dim=1), down=down)

    def _expert_tensors(self, layer: int, moe: MoEWeights, layout: Layout | None) -> dict[str, torch.Tensor]:
        inter = moe.intermediate_size
        return {
            self._fused_key(layer, "w13_weight"): interleaved(moe.gate_up[:, :inter], moe.gate_up[:, inter:], 1),
            self._fused_key(layer, "w2_weight"): moe.down,
        }
