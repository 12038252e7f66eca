"""Ling 2.5 (``bailing_hybrid``): DeepSeek-V3's MoE block (sigmoid scores plus a correction bias for the choice,
group-limited, renormalised, scaled by ``routed_scaling_factor``; shared experts; MoE where ``mlp_layer_types`` says
``sparse``, else from ``first_k_dense_replace``) whose experts clamp their SwiGLU with a limit per layer
(``expert_swiglu_limit_list``, :mod:`.swiglu_clamp`), in a decoder of KDA linear-attention layers and MLA layers
with an output gate (``layer_types``). Config keys as Kimi-Linear's (``num_experts``, ``num_experts_per_token``,
``moe_renormalize``, ``num_expert_group``).

On disk (the release's names, which transformers renames at load): ``model.word_embeddings`` (``model.embed_tokens``),
``attention.*`` (``self_attn.*``) with ``attention.dense`` (``o_proj``), a KDA layer's ``attention.{q,k,v}_conv1d``
(one ``conv1d`` at runtime) and ``attention.{f_proj,dt_bias,A_log}`` (under ``self_attn.forget_gate``), and
``mlp.gate.expert_bias`` (``mlp.gate.e_score_correction_bias``); experts per expert as DeepSeek-V3's.
"""

from __future__ import annotations

from .bailing_names import BailingNames
from .block_bias import CorrectionBiasOffRouter
from .kimi_linear import KimiLinearAdapter
from .swiglu_clamp import PerLayerSwigluClamp

_FORGET_GATE = ("f_proj.", "dt_bias", "A_log")


class BailingHybridAdapter(BailingNames, PerLayerSwigluClamp, CorrectionBiasOffRouter, KimiLinearAdapter):
    family = "bailing_hybrid"
    model_types = ("bailing_hybrid",)
    moe_disk_prefix = "mlp."
    expert_names = ("gate_proj", "up_proj", "down_proj")
    correction_bias_key = "mlp.gate.expert_bias"
    first_dense_default = 2

    def softmax_attention(self, layer: int) -> bool:
        kinds = self.text_config.get("layer_types")
        if kinds:
            return kinds[layer] == "full_attention"
        return (layer + 1) % int(self.text_config.get("layer_group_size") or 6) == 0

    def runtime_local_name(self, local_key: str) -> str:
        if not local_key.startswith("attention."):
            return local_key
        local_key = "self_attn." + local_key[len("attention.") :]
        if local_key.startswith("self_attn.dense."):
            return "self_attn.o_proj." + local_key[len("self_attn.dense.") :]
        if local_key.startswith(tuple(f"self_attn.{name}" for name in _FORGET_GATE)):
            return "self_attn.forget_gate." + local_key[len("self_attn.") :]
        return local_key
