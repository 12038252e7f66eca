"""Jamba: Mamba and attention layers (one attention layer in ``attn_layer_period``, at ``attn_layer_offset``), an MoE
feed-forward in one layer of ``expert_layer_period`` (at ``expert_layer_offset``), a dense MLP in the others. The MoE
block is ``feed_forward`` with its ``router`` and per-expert ``gate/up/down_proj`` on disk (fused at load); the router
takes the top-k of the softmax without renormalising."""

from __future__ import annotations

from .base import FamilyAdapter
from .routing import RoutingRule


class JambaAdapter(FamilyAdapter):
    family = "jamba"
    model_types = ("jamba",)
    moe_disk_prefix = "feed_forward."
    router_module = "feed_forward.router"
    router_key = "router"

    def is_moe_layer(self, layer: int) -> bool:
        cfg = self.text_config
        period, offset = int(cfg.get("expert_layer_period", 2)), int(cfg.get("expert_layer_offset", 1))
        return self.num_experts > 1 and layer % period == offset

    def softmax_attention(self, layer: int) -> bool:
        cfg = self.text_config
        return layer % int(cfg.get("attn_layer_period", 8)) == int(cfg.get("attn_layer_offset", 4))

    def routing_rule(self) -> RoutingRule:
        return RoutingRule("softmax_topk", top_k=self.top_k, normalize=False)
