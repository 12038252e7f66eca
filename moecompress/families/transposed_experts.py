"""Fused experts stored transposed: ``gate_up_proj`` ``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]`` (the
``fused_transposed`` layout of Qwen3-VL-MoE's hub release and of Llama 4; NVIDIA's NeMo export under other names),
read into and written from the canonical view."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import Layout, MoEWeights


class TransposedFusedExperts:
    """Mixin, listed before the family's adapter class; the family's ``detect_layout`` says when a layer is
    ``fused_transposed``."""

    transposed_expert_names: ClassVar[tuple[str, str]] = ("gate_up_proj", "down_proj")
    """The fused tensors' names under the experts (input projection, down projection)."""

    def _pop_experts(self, layer: int, rest: dict[str, torch.Tensor], layout: Layout) -> MoEWeights:
        if layout != "fused_transposed":
            return super()._pop_experts(layer, rest, layout)
        gate_up_name, down_name = self.transposed_expert_names
        gate_up = rest.pop(self._fused_key(layer, gate_up_name))
        down = rest.pop(self._fused_key(layer, down_name))
        return MoEWeights(
            router_weight=torch.empty(0, device="cpu"),
            gate_up=gate_up.transpose(1, 2).contiguous(),
            down=down.transpose(1, 2).contiguous(),
        )

    def _expert_tensors(self, layer: int, moe: MoEWeights, layout: Layout | None) -> dict[str, torch.Tensor]:
        if layout != "fused_transposed":
            return super()._expert_tensors(layer, moe, layout)
        gate_up_name, down_name = self.transposed_expert_names
        return {
            self._fused_key(layer, gate_up_name): moe.gate_up.transpose(1, 2).contiguous(),
            self._fused_key(layer, down_name): moe.down.transpose(1, 2).contiguous(),
        }
