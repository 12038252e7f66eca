"""Hunyuan MoE (``hunyuan_v1_moe``): the router's linear layer is ``mlp.gate.wg``; per-expert ``gate/up/down_proj``;
a shared expert ``mlp.shared_mlp``; softmax, top-k (``moe_topk``), renormalised; per-head q/k norms
(``query_layernorm``/``key_layernorm``)."""

from __future__ import annotations

import torch

from .base import FamilyAdapter, MoEWeights


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
