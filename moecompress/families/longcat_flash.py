"""LongCat-Flash (``longcat_flash``): zero-computation experts beside the FFN experts, a shortcut MoE.

Each decoder layer holds two MLA attention blocks (``self_attn.0``/``.1``), two dense MLPs (``mlps.0``/``.1``) and one
MoE block (``mlp``) that reads the first attention block's output and is added at the layer's end. The router
(``mlp.router.classifier``, with ``mlp.router.e_score_correction_bias``) scores ``n_routed_experts`` FFN experts
then ``zero_expert_num`` identity experts: softmax over all of them, choice on the scores plus the bias, weights the
uncorrected scores times ``routed_scaling_factor``, never renormalised; an identity expert's output is its weight
times the token. Pruning removes FFN experts only: the router keeps every identity row, and the config's
``n_routed_experts`` says how many FFN experts remain, as stock transformers builds the router from both counts.

The release (``meituan-longcat/LongCat-Flash-Chat``) stores experts per expert (``mlp.experts.{e}.gate_proj``...),
which transformers fuses at load; ``model.mtp.*`` is skipped by transformers and copied through unchanged here.
The config counts ``num_layers`` decoder layers (transformers' ``num_hidden_layers`` is twice that: one per
attention block).
"""

from __future__ import annotations

from typing import Any

from .base import FamilyAdapter
from .rerouted_block import StockBlockRerouted
from .routing import RoutingRule


class LongcatFlashAdapter(StockBlockRerouted, FamilyAdapter):
    family = "longcat_flash"
    model_types = ("longcat_flash",)
    router_module = "mlp.router"
    attention_module = "self_attn.0"
    """The attention block whose output the MoE block reads (the attention each token receives, for MAEP)."""
    router_key = "router"
    num_experts_keys = ("n_routed_experts",)
    shared_expert_markers = ()
    has_correction_bias = True

    def __init__(self, config: dict[str, Any]):
        from ..errors import UserInputError

        super().__init__(config)
        kind = self.text_config.get("zero_expert_type", "identity")
        if self.identity_experts(0) and kind != "identity":
            raise UserInputError(f"longcat_flash: zero_expert_type {kind!r} is not supported (only 'identity')")

    @property
    def num_layers(self) -> int:
        return int(self.text_config["num_layers"])

    @property
    def top_k(self) -> int:
        return int(self.text_config["moe_topk"])

    def identity_experts(self, layer: int) -> int:
        return int(self.text_config.get("zero_expert_num") or 0)

    def head_counts(self) -> tuple[int, int, int]:
        cfg = self.text_config
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        return heads, kv_heads, int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])

    def routing_rule(self) -> RoutingRule:
        scaling = float(self.text_config.get("routed_scaling_factor", 1.0))
        return RoutingRule("softmax_bias_topk", top_k=self.top_k, normalize=False, scaling=scaling)

    def _router_key(self, layer: int, name: str) -> str:
        if name in ("weight", "bias"):
            return f"{self.layer_prefix(layer)}{self.router_module}.classifier.{name}"
        return super()._router_key(layer, name)

    def runtime_router_state(self, moe) -> dict:
        state = {f"{self.router_module}.classifier.weight": moe.router_weight}
        if moe.router_bias is not None:
            state[f"{self.router_module}.classifier.bias"] = moe.router_bias
        if moe.correction_bias is not None:
            state[f"{self.router_module}.e_score_correction_bias"] = moe.correction_bias
        return state
