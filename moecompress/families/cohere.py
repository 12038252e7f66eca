"""Cohere2-MoE (``cohere2_moe``): Qwen-style on-disk names (``mlp.gate``, per-expert
``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_experts``) in a parallel decoder layer (attention and MoE block
read the same normed input); the first layers dense as ``mlp_layer_types`` (or ``first_k_dense_replace``) says.

The router takes the top-k logits and weighs them by a softmax over those k (``expert_selection_fn: softmax``) or by
each one's sigmoid, renormalised if ``norm_topk_prob`` (``sigmoid``: the top-k of the sigmoid scores, rule
``sigmoid_group_topk`` with one group, no correction bias and nothing added to the sum). With
``shared_expert_combination_strategy: average`` the block halves the sum of routed and shared outputs; that factor is
outside the routed experts' view.
"""

from __future__ import annotations

from .base import FamilyAdapter
from .routing import RoutingRule


class Cohere2MoeAdapter(FamilyAdapter):
    family = "cohere2_moe"
    model_types = ("cohere2_moe",)
    num_experts_keys = ("num_experts",)

    def is_moe_layer(self, layer: int) -> bool:
        return self.listed_moe_layer(layer, layer >= int(self.text_config.get("first_k_dense_replace") or 0))

    def routing_rule(self) -> RoutingRule:
        selection = self.text_config.get("expert_selection_fn", "softmax")
        if selection == "softmax":
            return RoutingRule("topk_softmax", top_k=self.top_k)
        if selection == "sigmoid":
            normalize = bool(self.text_config.get("norm_topk_prob", True))
            return RoutingRule("sigmoid_group_topk", top_k=self.top_k, normalize=normalize, norm_eps=0.0)
        from ..errors import UserInputError

        raise UserInputError(f"cohere2_moe: unknown expert_selection_fn {selection!r} (softmax or sigmoid)")
