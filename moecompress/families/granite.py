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


class GraniteMoeSharedAdapter(GraniteMoeAdapter):
    """GraniteMoE with a dense shared MLP beside the MoE block (``shared_mlp.input_linear``/``output_linear``)."""

    family = "granitemoeshared"
    model_types = ("granitemoeshared",)
    shared_expert_markers = ("shared_mlp",)


class GraniteMoeHybridAdapter(GraniteMoeSharedAdapter):
    """Granite 4.0 (``granitemoehybrid``): GraniteMoE-shared layers whose token mixer is a Mamba-2 layer or attention,
    as ``layer_types`` says; a config with no experts is a dense model."""

    family = "granitemoehybrid"
    model_types = ("granitemoehybrid",)


class GraniteMoeSWAAdapter(GraniteMoeSharedAdapter):
    """GraniteMoE-SWA (``granitemoe_swa``): sliding-window and full attention layers (with attention sinks);
    transformers has no conversion rule for it, so its checkpoints hold the runtime names:
    ``block_sparse_moe.experts.gate_up_proj`` ``[E, 2I, H]``, ``block_sparse_moe.experts.down_proj`` ``[E, H, I]``,
    ``block_sparse_moe.router.weight``."""

    family = "granitemoe_swa"
    model_types = ("granitemoe_swa",)

    def _router_key(self, layer: int, name: str) -> str:
        return FamilyAdapter._router_key(self, layer, name)

    def _fused_key(self, layer: int, name: str) -> str:
        return FamilyAdapter._fused_key(self, layer, name)
