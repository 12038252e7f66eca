"""Lara-4-Mini (``lara_mini``): Qwen3-Next's MoE block (``mlp.gate`` softmax top-k, renormalised if
``norm_topk_prob``; experts fused as ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``
``[E, H, I]``) with an ungated, always-on ``mlp.shared_expert``, in every layer of a decoder whose token mixers are
Gated DeltaNet, sliding or full attention (``layer_types``). Its checkpoints hold the Gated DeltaNet input projections
fused as ``linear_attn.in_proj`` (rows ``[q|k|v|z|b|a]``) and the output norm as ``linear_attn.out_norm``; transformers
splits and renames them at load, and so does :meth:`runtime_local_state` for the stand-in layers."""

from __future__ import annotations

import torch

from .base import FamilyAdapter

_FUSED_IN = "linear_attn.in_proj.weight"


class LaraMiniAdapter(FamilyAdapter):
    family = "lara_mini"
    model_types = ("lara_mini",)

    def runtime_local_name(self, local_key: str) -> str:
        if local_key.startswith("linear_attn.out_norm."):
            return "linear_attn.norm." + local_key[len("linear_attn.out_norm.") :]
        return local_key

    def runtime_local_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if _FUSED_IN not in state:
            return state
        cfg = self.text_config
        key_dim = int(cfg["linear_key_head_dim"]) * int(cfg["linear_num_key_heads"])
        v_heads = int(cfg["linear_num_value_heads"])
        value_dim = int(cfg["linear_value_head_dim"]) * v_heads
        state = dict(state)
        parts = torch.split(state.pop(_FUSED_IN), [2 * key_dim + value_dim, value_dim, v_heads, v_heads], dim=0)
        for name, part in zip(("qkv", "z", "b", "a"), parts, strict=True):
            state[f"linear_attn.in_proj_{name}.weight"] = part
        return state
