"""GraniteMoE (``granitemoe``): experts fused on disk as ``block_sparse_moe.input_linear.weight`` ``[E, 2I, H]``
(gate rows first) and ``block_sparse_moe.output_linear.weight`` ``[E, H, I]``, the router's linear layer
``block_sparse_moe.router.layer``; top-k of the logits, softmax over those k. transformers renames them to
``experts.gate_up_proj``/``experts.down_proj``/``router.weight`` under the same ``block_sparse_moe`` module.
"""

from __future__ import annotations

from .base import FamilyAdapter, Layout
from .routing import RoutingRule


class GraniteMoeAdapter(FamilyAdapter):
    family = "granitemoe"
    model_types = ("granitemoe",)
    moe_disk_prefix = "block_sparse_moe."
    router_module = "block_sparse_moe.router"
    router_key = "router"
    num_experts_keys = ("num_local_experts", "num_experts")

    def routing_rule(self) -> RoutingRule:
        return RoutingRule("topk_softmax", top_k=self.top_k)

    def _router_key(self, layer: int, name: str) -> str:
        return f"{self.layer_prefix(layer)}block_sparse_moe.router.layer.{name}"

    def _fused_key(self, layer: int, name: str) -> str:
        disk = {"gate_up_proj": "input_linear.weight", "down_proj": "output_linear.weight"}[name]
        return f"{self.layer_prefix(layer)}block_sparse_moe.{disk}"

    def detect_layout(self, layer: int, keys) -> Layout:
        if self._fused_key(layer, "gate_up_proj") in keys:
            return "fused"
        raise KeyError(f"layer {layer}: no expert tensors found under {self.layer_prefix(layer)}block_sparse_moe")

    def classify_key(self, key: str):
        if key.endswith(("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight")):
            return "experts"
        return super().classify_key(key)
