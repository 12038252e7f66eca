"""MiniMax (``minimax``, the transformers port of MiniMax-Text-01: lightning linear attention in the layers
``layer_types`` marks ``linear_attention``) and MiniMax-M2 (``minimax_m2``): Mixtral's on-disk layout
(``block_sparse_moe`` with per-expert ``w1``/``w3``/``w2``).

MiniMax routes like Mixtral. MiniMax-M2 routes by sigmoid scores plus ``block_sparse_moe.e_score_correction_bias``
(a buffer of the MoE block, not of its router, which the block hands to the router's forward), top-k without
groups, weights renormalised.
"""

from __future__ import annotations

import torch

from .base import MoEWeights
from .block_bias import CorrectionBiasOffRouter
from .mixtral import MixtralAdapter
from .routing import RoutingRule


class MiniMaxAdapter(MixtralAdapter):
    family = "minimax"
    model_types = ("minimax",)
    head_pruning = False


class MiniMaxM2Adapter(CorrectionBiasOffRouter, MixtralAdapter):
    family = "minimax_m2"
    model_types = ("minimax_m2",)
    correction_bias_key = "block_sparse_moe.e_score_correction_bias"
    head_pruning = False
    has_correction_bias = True

    def routing_rule(self) -> RoutingRule:
        return RoutingRule("sigmoid_group_topk", top_k=self.top_k, normalize=True)

    def runtime_router_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        state = super().runtime_router_state(moe)
        bias = state.pop("mlp.gate.e_score_correction_bias", None)
        if bias is not None:
            state["mlp.e_score_correction_bias"] = bias
        return state

    def stock_route(self, model: torch.nn.Module, layer: int, hidden: torch.Tensor):
        block = self.moe_block_of(model, layer)
        return block.gate(hidden, block.e_score_correction_bias)
