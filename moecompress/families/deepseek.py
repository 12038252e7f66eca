"""DeepSeek-V2 and V3: MLA attention, shared experts, the first layers dense.

V2 routes softmax → (group-limited) greedy top-k without renormalising; V3 routes sigmoid + the
``e_score_correction_bias`` for the choice, group-limited, weights renormalised, both scaled by
``routed_scaling_factor``.
"""

from __future__ import annotations

from typing import ClassVar

from .base import FamilyAdapter
from .routing import RoutingRule


class _DeepseekAdapter(FamilyAdapter):
    num_experts_keys = ("n_routed_experts", "num_local_experts")
    first_dense_default: ClassVar[int] = 0

    def is_moe_layer(self, layer: int) -> bool:
        cfg = self.text_config
        first_dense = int(cfg.get("first_k_dense_replace", self.first_dense_default) or 0)
        freq = int(cfg.get("moe_layer_freq") or 1)
        return self.listed_moe_layer(layer, layer >= first_dense and layer % freq == 0)

    def head_counts(self) -> tuple[int, int, int]:
        cfg = self.text_config
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("qk_nope_head_dim", 0)) + int(cfg.get("qk_rope_head_dim", 0))
        return heads, kv_heads, head_dim or int(cfg["hidden_size"]) // heads


class DeepseekV2Adapter(_DeepseekAdapter):
    family = "deepseek_v2"
    model_types = ("deepseek_v2",)
    per_expert_linears = True

    def routing_rule(self) -> RoutingRule:
        cfg = self.text_config
        grouped = cfg.get("topk_method", "greedy") == "group_limited_greedy"
        return RoutingRule(
            "softmax_group_topk",
            top_k=self.top_k,
            normalize=False,
            scaling=float(cfg.get("routed_scaling_factor", 1.0)),
            n_group=int(cfg.get("n_group") or 1) if grouped else 1,
            topk_group=int(cfg.get("topk_group") or 1) if grouped else 1,
        )


class DeepseekV3Adapter(_DeepseekAdapter):
    family = "deepseek_v3"
    model_types = ("deepseek_v3",)
    per_expert_linears = True
    has_correction_bias = True

    def routing_rule(self) -> RoutingRule:
        cfg = self.text_config
        return RoutingRule(
            "sigmoid_group_topk",
            top_k=self.top_k,
            normalize=bool(cfg.get("norm_topk_prob", True)),
            scaling=float(cfg.get("routed_scaling_factor", 1.0)),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
        )
