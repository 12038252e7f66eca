"""GLM-5.3-Flash (``glm5_next``): GLM-5's MoE block (DeepSeek-V3's sigmoid router with ``e_score_correction_bias``,
renormalised, scaled; a shared expert; ``mlp_layer_types``, the first three layers dense without it) with the
routed, shared and dense SwiGLUs clamped at one ``swiglu_limit`` (gate from above, up on both sides), under
hyper-connections (decoder-layer hidden states ``[B, S, hc_mult, H]``), Kimi Delta Attention layers and NoPE MLA
layers with a pooled DSA indexer (``layer_types``). The text model sits under ``model.language_model`` beside the
vision tower ``model.visual``.

Each decoder layer hands its indexer's top-k to the next (:mod:`.indexer_topk`).

On disk (transformers' ``glm5_next`` renames reversed, as ``save_pretrained`` writes them): per-expert
``mlp.experts.{e}.{gate,up,down}_proj``, ``hc_{attn,ffn}_{fn,base,scale}`` (``{attn,ffn}_hc.*`` at runtime), a KDA
layer's ``self_attn.{q,k,v}_conv1d`` (one ``conv1d`` at runtime) and ``self_attn.f_a_proj`` / ``f_b_proj`` /
``dt_bias`` / ``A_log`` (under ``self_attn.forget_gate`` at runtime).
"""

from __future__ import annotations

import torch

from .deepseek import DeepseekV3Adapter
from .indexer_topk import CarriedIndexerTopK
from .kda_names import kda_runtime_name, kda_runtime_state
from .swiglu_clamp import OneSwigluLimit
from .vision_language import TextTowerBesideVision

_HYPER_CONNECTIONS = tuple(
    (f"hc_{site}_{part}", f"{site}_hc.{part}") for site in ("attn", "ffn") for part in ("fn", "base", "scale")
)


class Glm5NextAdapter(TextTowerBesideVision, OneSwigluLimit, CarriedIndexerTopK, DeepseekV3Adapter):
    family = "glm5_next"
    model_types = ("glm5_next",)
    first_dense_default = 3

    def runtime_local_name(self, local_key: str) -> str:
        for disk, runtime in _HYPER_CONNECTIONS:
            if local_key == disk:
                return runtime
        return kda_runtime_name(local_key)

    def runtime_local_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return kda_runtime_state(state)
