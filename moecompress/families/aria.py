"""Aria (``aria_text``, and ``aria``: that text model under ``language_model.model.*`` beside a vision tower and a
cross-attention projector). The MoE block is ``mlp``: router ``mlp.router`` (top-k of the logits, softmax over those
k), routed experts fused and stored transposed as ``mlp.experts.fc1.weight`` ``[E, H, 2I]`` (gate columns first) and
``mlp.experts.fc2.weight`` ``[E, I, H]``, and always-on ``mlp.shared_experts``. transformers renames ``fc1``/``fc2``
to ``gate_up_proj``/``down_proj`` at load and keeps the transposed orientation at runtime. The routed experts are
always SiLU-gated (``hidden_act`` is the shared experts')."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import FamilyAdapter, Layout, MoEWeights
from .llava_layout import LlavaLayout
from .routing import RoutingRule
from .transposed_experts import TransposedFusedExperts

_DISK_NAMES = {"gate_up_proj": "fc1.weight", "down_proj": "fc2.weight"}


class AriaTextAdapter(TransposedFusedExperts, FamilyAdapter):
    family = "aria_text"
    model_types = ("aria_text",)
    router_module = "mlp.router"
    router_key = "router"
    num_experts_keys = ("moe_num_experts",)
    shared_expert_markers = ("shared_experts",)

    @property
    def top_k(self) -> int:
        return int(self.text_config["moe_topk"])

    def routing_rule(self) -> RoutingRule:
        return RoutingRule("topk_softmax", top_k=self.top_k)

    def activation(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def _fused_key(self, layer: int, name: str) -> str:
        return f"{self.layer_prefix(layer)}mlp.experts.{_DISK_NAMES[name]}"

    def detect_layout(self, layer: int, keys) -> Layout:
        if self._fused_key(layer, "gate_up_proj") in keys:
            return "fused_transposed"
        raise KeyError(f"layer {layer}: no expert tensors found under {self.layer_prefix(layer)}mlp.experts")

    def runtime_moe_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        """The runtime experts keep the on-disk orientation under the runtime names."""
        state = {
            f"{self.experts_module}.gate_up_proj": moe.gate_up.transpose(1, 2).contiguous(),
            f"{self.experts_module}.down_proj": moe.down.transpose(1, 2).contiguous(),
        }
        state.update(self.runtime_router_state(moe))
        return state


class AriaAdapter(LlavaLayout, AriaTextAdapter):
    family = "aria"
    model_types = ("aria",)
    vision_prefixes = ("vision_tower.", "multi_modal_projector.")
