"""ERNIE 4.5 MoE: ``mlp.gate`` router whose choice adds a correction bias to the softmax scores, stored apart as
``mlp.moe_statics.e_score_correction_bias`` ``[1, E]`` (transformers moves it under the router at load); per-expert
``gate/up/down_proj``; ``mlp.shared_experts``; MoE layers from ``moe_layer_start_index`` to ``moe_layer_end_index``
every ``moe_layer_interval``.
"""

from __future__ import annotations

import torch

from .base import FamilyAdapter, Layout, MoEWeights
from .block_bias import CorrectionBiasOffRouter
from .routing import RoutingRule


class Ernie45MoeAdapter(CorrectionBiasOffRouter, FamilyAdapter):
    family = "ernie4_5_moe"
    model_types = ("ernie4_5_moe",)
    correction_bias_key = "mlp.moe_statics.e_score_correction_bias"
    num_experts_keys = ("moe_num_experts", "num_experts")
    shared_expert_markers = ("shared_experts",)
    has_correction_bias = True

    @property
    def top_k(self) -> int:
        cfg = self.text_config
        return int(cfg["moe_k"] if "moe_k" in cfg else cfg["num_experts_per_tok"])

    def is_moe_layer(self, layer: int) -> bool:
        cfg = self.text_config
        if self.num_experts <= 0:
            return False
        start = int(cfg.get("moe_layer_start_index") or 0)
        end = cfg.get("moe_layer_end_index")
        end = self.num_layers - 1 if end is None or int(end) < 0 else int(end)
        interval = int(cfg.get("moe_layer_interval") or 1)
        return (layer + 1) % interval == 0 and start <= layer <= end

    def routing_rule(self) -> RoutingRule:
        return RoutingRule(
            "softmax_bias_topk", top_k=self.top_k, norm_min=float(self.text_config.get("moe_norm_min", 1e-12))
        )

    def split_layer(self, layer: int, tensors: dict, *, consume: bool = False):
        moe, rest, layout = super().split_layer(layer, tensors, consume=consume)
        if moe is not None and moe.correction_bias is not None:
            moe.correction_bias = moe.correction_bias.reshape(-1)
        return moe, rest, layout

    def join_layer(self, layer: int, moe: MoEWeights | None, rest: dict[str, torch.Tensor], layout: Layout | None):
        out = super().join_layer(layer, moe, rest, layout)
        key = self._router_key(layer, "e_score_correction_bias")
        if key in out:
            out[key] = out[key].reshape(1, -1)
        return out

    def runtime_router_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        state = super().runtime_router_state(moe)
        bias = state.pop("mlp.gate.e_score_correction_bias", None)
        if bias is not None:
            state["mlp.gate.moe_statics.e_score_correction_bias"] = bias.reshape(1, -1)
        return state
