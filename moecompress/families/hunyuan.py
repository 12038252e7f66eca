"""Hunyuan MoE (``hunyuan_v1_moe``): the router's linear layer is ``mlp.gate.wg``; per-expert ``gate/up/down_proj``;
a shared expert ``mlp.shared_mlp``; softmax, top-k (``moe_topk``), renormalised; per-head q/k norms
(``query_layernorm``/``key_layernorm``)."""

from __future__ import annotations

import torch

from .base import FamilyAdapter, MoEWeights
from .block_bias import CorrectionBiasOffRouter
from .routing import RoutingRule


class HunyuanMoeAdapter(FamilyAdapter):
    family = "hunyuan_v1_moe"
    model_types = ("hunyuan_v1_moe",)
    shared_expert_markers = ("shared_mlp",)

    def __init__(self, config: dict):
        super().__init__(config)
        for key in ("num_experts", "moe_topk"):
            if isinstance(self.text_config.get(key), list):
                from ..errors import UserInputError

                raise UserInputError(f"hunyuan_v1_moe: a per-layer {key} list is not supported")

    @property
    def top_k(self) -> int:
        cfg = self.text_config
        return int(cfg["moe_topk"] if "moe_topk" in cfg else cfg["num_experts_per_tok"])

    def _router_key(self, layer: int, name: str) -> str:
        return f"{self.layer_prefix(layer)}mlp.gate.wg.{name}"

    def runtime_router_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        state = super().runtime_router_state(moe)
        state["mlp.gate.wg.weight"] = state.pop("mlp.gate.weight")
        return state


class HYV3Adapter(CorrectionBiasOffRouter, FamilyAdapter):
    """HY-V3 (``hy_v3``): sigmoid scores plus a per-expert bias kept on the MoE block (``mlp.expert_bias``, handed to
    the router's forward as MiniMax-M2's), top-k without groups, renormalised, scaled by ``router_scaling_factor``.
    On disk the router's linear layer is ``mlp.router.gate`` and the shared expert ``mlp.shared_mlp``; transformers
    renames them to ``mlp.gate`` and ``mlp.shared_experts`` (and the bias to ``mlp.e_score_correction_bias``).
    Without ``mlp_layer_types`` the first layer is dense."""

    family = "hy_v3"
    model_types = ("hy_v3",)
    router_key = "router"
    correction_bias_key = "mlp.expert_bias"
    has_correction_bias = True
    shared_expert_markers = ("shared_mlp",)
    num_experts_keys = ("num_experts", "num_local_experts")

    def is_moe_layer(self, layer: int) -> bool:
        return self.listed_moe_layer(layer, layer >= 1)

    def routing_rule(self) -> RoutingRule:
        scale = float(self.text_config.get("router_scaling_factor") or 1.0)
        return RoutingRule("sigmoid_group_topk", top_k=self.top_k, normalize=True, scaling=scale)

    def _router_key(self, layer: int, name: str) -> str:
        if name == "weight":
            return f"{self.layer_prefix(layer)}mlp.router.gate.weight"
        return super()._router_key(layer, name)

    def runtime_local_name(self, local_key: str) -> str:
        return local_key.replace("mlp.shared_mlp.", "mlp.shared_experts.", 1)

    def runtime_router_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        state = {"mlp.gate.weight": moe.router_weight}
        if moe.correction_bias is not None:
            state["mlp.e_score_correction_bias"] = moe.correction_bias
        return state

    def stock_route(self, model: torch.nn.Module, layer: int, hidden: torch.Tensor):
        block = self.moe_block_of(model, layer)
        return block.gate(hidden, block.e_score_correction_bias)
