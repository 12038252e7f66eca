"""Kimi Delta Attention layers' on-disk tensors (Kimi Linear, GLM-5.3-Flash; Ling 2.5 for the convolutions): the
forget gate's ``f_a_proj`` / ``f_b_proj`` / ``dt_bias`` / ``A_log`` sit under ``self_attn.forget_gate`` at runtime,
and the three short convolutions ``self_attn.{q,k,v}_conv1d`` are one ``self_attn.conv1d`` there."""

from __future__ import annotations

import torch

_FORGET_GATE = tuple(f"self_attn.{name}" for name in ("f_a_proj.", "f_b_proj.", "dt_bias", "A_log"))
_CONVOLUTIONS = tuple(f"self_attn.{part}_conv1d.weight" for part in ("q", "k", "v"))


def kda_runtime_name(local_key: str) -> str:
    if local_key.startswith(_FORGET_GATE):
        return "self_attn.forget_gate." + local_key[len("self_attn.") :]
    return local_key


def kda_runtime_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The layer's tensors with the three convolutions concatenated (q, k, v) where the layer has them."""
    if not all(name in state for name in _CONVOLUTIONS):
        return state
    state = dict(state)
    state["self_attn.conv1d.weight"] = torch.cat([state.pop(name) for name in _CONVOLUTIONS], dim=0)
    return state
