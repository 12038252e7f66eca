"""Kimi-Linear (``kimi_linear``): DeepSeek-V3's routing (sigmoid, correction bias, groups, renormalised, scaled) and
MLA full-attention layers between Kimi Delta Attention (KDA) linear-attention layers.

On disk (the release's names, which transformers renames at load): the MoE block is ``block_sparse_moe`` with
per-expert ``w1``/``w3``/``w2``, the router ``block_sparse_moe.gate`` (``weight``, ``e_score_correction_bias``) and
``block_sparse_moe.shared_experts``; dense layers keep their MLP under ``block_sparse_moe`` too. A KDA layer stores
``self_attn.{q,k,v}_conv1d`` (one ``conv1d`` at runtime) and ``self_attn.f_a_proj`` / ``f_b_proj`` / ``dt_bias`` /
``A_log`` (under ``self_attn.forget_gate`` at runtime). ``config.json`` names the MoE settings ``num_experts``,
``num_experts_per_token``, ``moe_renormalize``, ``num_expert_group``; the attention kind of each layer comes from
``layer_types`` or the release's ``linear_attn_config`` (1-based ``full_attn_layers``/``kda_layers``).
"""

from __future__ import annotations

import torch

from .deepseek import DeepseekV3Adapter
from .kda_names import kda_runtime_name, kda_runtime_state
from .routing import RoutingRule


class KimiLinearAdapter(DeepseekV3Adapter):
    family = "kimi_linear"
    model_types = ("kimi_linear",)
    moe_disk_prefix = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")
    num_experts_keys = ("num_experts", "num_local_experts", "n_routed_experts")
    first_dense_default = 1

    def _setting(self, *keys: str, default=None):
        cfg = self.text_config
        return next((cfg[key] for key in keys if cfg.get(key) is not None), default)

    @property
    def top_k(self) -> int:
        return int(self._setting("num_experts_per_token", "num_experts_per_tok"))

    def routing_rule(self) -> RoutingRule:
        return RoutingRule(
            "sigmoid_group_topk",
            top_k=self.top_k,
            normalize=bool(self._setting("moe_renormalize", "norm_topk_prob", default=True)),
            scaling=float(self._setting("routed_scaling_factor", default=1.0)),
            n_group=int(self._setting("num_expert_group", "n_group", default=1)),
            topk_group=int(self._setting("topk_group", default=1)),
        )

    def softmax_attention(self, layer: int) -> bool:
        cfg = self.text_config
        if cfg.get("layer_types"):
            return cfg["layer_types"][layer] == "full_attention"
        linear = cfg.get("linear_attn_config") or {}
        if "kda_layers" in linear:
            return layer + 1 not in linear["kda_layers"]
        return bool(layer) and layer % 4 == 0

    def runtime_local_name(self, local_key: str) -> str:
        return kda_runtime_name(local_key.replace("block_sparse_moe.", "mlp.", 1))

    def runtime_local_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return kda_runtime_state(state)
