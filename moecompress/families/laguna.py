"""Laguna (``laguna``, poolside): sigmoid scores (of the router logits soft-capped by ``tanh`` when
``moe_router_logit_softcapping`` is set) plus a correction bias for the choice, top-k without groups, weights
renormalised; the MoE block, not the router, multiplies the routed output by ``moe_routed_scaling_factor``, a factor
outside the routed experts' view. On disk the bias is ``mlp.experts.e_score_correction_bias`` and the shared expert
``mlp.shared_expert``; transformers renames them to ``mlp.gate.e_score_correction_bias`` and ``mlp.shared_experts``.
Without ``mlp_layer_types`` the first layer is dense.
"""

from __future__ import annotations

import torch

from .base import FamilyAdapter, MoEWeights
from .block_bias import CorrectionBiasOffRouter
from .routing import RoutingRule


class LagunaAdapter(CorrectionBiasOffRouter, FamilyAdapter):
    family = "laguna"
    model_types = ("laguna",)
    correction_bias_key = "mlp.experts.e_score_correction_bias"
    has_correction_bias = True
    num_experts_keys = ("num_experts", "num_local_experts")

    def is_moe_layer(self, layer: int) -> bool:
        return self.listed_moe_layer(layer, layer >= 1)

    def routing_rule(self) -> RoutingRule:
        return RoutingRule("sigmoid_group_topk", top_k=self.top_k, normalize=True, norm_eps=0.0)

    def router_logits(self, moe: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().router_logits(moe, hidden)
        cap = float(self.text_config.get("moe_router_logit_softcapping") or 0.0)
        return torch.tanh(logits / cap) * cap if cap > 0.0 else logits

    def runtime_local_name(self, local_key: str) -> str:
        return local_key.replace("mlp.shared_expert.", "mlp.shared_experts.", 1)
