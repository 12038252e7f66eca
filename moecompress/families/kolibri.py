"""Kolibri (``kolibri1``, Aleph Alpha): every decoder layer MoE, with a shared expert; the router picks experts by
their logits plus a correction bias and weighs each by the sigmoid of its logit, renormalised if ``norm_topk_prob``
(rule ``bias_topk_sigmoid``). The release keeps the bias at the decoder layer (``moe.router.expert_bias``) and names
the sandwich norms ``post_attn_norm`` / ``post_ffn_norm``; transformers renames them to
``mlp.gate.e_score_correction_bias``, ``post_self_attn_layernorm`` and ``post_mlp_layernorm`` at load.
"""

from __future__ import annotations

from .base import FamilyAdapter
from .block_bias import CorrectionBiasOffRouter
from .routing import RoutingRule

_LOCAL_RENAMES = (("post_attn_norm.", "post_self_attn_layernorm."), ("post_ffn_norm.", "post_mlp_layernorm."))


class Kolibri1Adapter(CorrectionBiasOffRouter, FamilyAdapter):
    family = "kolibri1"
    model_types = ("kolibri1",)
    correction_bias_key = "moe.router.expert_bias"
    has_correction_bias = True
    num_experts_keys = ("num_local_experts", "num_experts")

    def routing_rule(self) -> RoutingRule:
        return RoutingRule(
            "bias_topk_sigmoid", top_k=self.top_k, normalize=bool(self.text_config.get("norm_topk_prob", False))
        )

    def runtime_local_name(self, local_key: str) -> str:
        for disk, runtime in _LOCAL_RENAMES:
            if local_key.startswith(disk):
                return runtime + local_key[len(disk) :]
        return local_key
