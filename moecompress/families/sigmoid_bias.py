"""Families whose router picks by sigmoid scores plus a per-expert bias kept on the MoE block (not on the router) and
handed to the router's forward: AFMoE (Arcee Trinity) and LFM2-MoE. Both route like DeepSeek-V3 without groups.

- AFMoE (``afmoe``): router linear ``mlp.router.gate``, bias ``mlp.expert_bias``, per-expert ``gate/up/down_proj``,
  ``mlp.shared_experts``; weights renormalised and scaled by ``route_scale``; the first ``num_dense_layers`` dense.
- LFM2-MoE (``lfm2_moe``): block ``feed_forward`` with router ``feed_forward.gate``, bias
  ``feed_forward.expert_bias`` (when ``use_expert_bias``), per-expert ``w1``/``w3``/``w2``; weights renormalised
  (+1e-6) if ``norm_topk_prob`` and scaled by ``routed_scaling_factor``; short-convolution and attention layers.
"""

from __future__ import annotations

import torch

from .base import FamilyAdapter, MoEWeights
from .routing import RoutingRule


class _BlockBiasAdapter(FamilyAdapter):
    has_correction_bias = True
    bias_name: str = "expert_bias"
    router_weight_name: str = "weight"

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer >= int(self.text_config.get("num_dense_layers") or 0)

    def _router_key(self, layer: int, name: str) -> str:
        if name == "e_score_correction_bias":
            return f"{self.layer_prefix(layer)}{self.moe_block_name}.{self.bias_name}"
        if name == "weight":
            return f"{self.layer_prefix(layer)}{self.router_module}.{self.router_weight_name}"
        return super()._router_key(layer, name)

    def classify_key(self, key: str):
        return "router" if key.endswith(f"{self.moe_block_name}.{self.bias_name}") else super().classify_key(key)

    def runtime_router_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        state = {f"{self.router_module}.{self.router_weight_name}": moe.router_weight}
        if moe.correction_bias is not None:
            state[f"{self.moe_block_name}.{self.bias_name}"] = moe.correction_bias
        return state


class AfmoeAdapter(_BlockBiasAdapter):
    family = "afmoe"
    model_types = ("afmoe",)
    router_module = "mlp.router"
    router_key = "router"
    router_weight_name = "gate.weight"
    shared_expert_markers = ("shared_experts",)

    def routing_rule(self) -> RoutingRule:
        scale = float(self.text_config.get("route_scale", 1.0))
        return RoutingRule("sigmoid_group_topk", top_k=self.top_k, normalize=True, scaling=scale)

    def stock_route(self, model: torch.nn.Module, layer: int, hidden: torch.Tensor):
        block = self.moe_block_of(model, layer)
        return block.router(hidden.unsqueeze(0), block.expert_bias)


class Lfm2MoeAdapter(_BlockBiasAdapter):
    family = "lfm2_moe"
    model_types = ("lfm2_moe",)
    moe_disk_prefix = "feed_forward."
    router_module = "feed_forward.gate"
    expert_names = ("w1", "w3", "w2")

    def routing_rule(self) -> RoutingRule:
        cfg = self.text_config
        return RoutingRule(
            "sigmoid_group_topk",
            top_k=self.top_k,
            normalize=bool(cfg.get("norm_topk_prob", True)),
            scaling=float(cfg.get("routed_scaling_factor", 1.0)),
            norm_eps=1e-6,
        )

    def stock_route(self, model: torch.nn.Module, layer: int, hidden: torch.Tensor):
        block = self.moe_block_of(model, layer)
        return block.gate(hidden, block.expert_bias if block.use_expert_bias else None)
