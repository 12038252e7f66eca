"""HY-V4 (``hy_v4``, Tencent Hy4): DeepSeek-V3's MoE block (sigmoid scores with ``e_score_correction_bias``,
group-limited top-k, renormalised, scaled; a shared expert; ``mlp_layer_types``, the first layer dense) with experts
fused on disk (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``down_proj``) whose SwiGLU is clamped at
``swiglu_limit`` (gate from above, up on both sides), under MLA attention with an output gate, attention sinks and a
sparse-attention indexer, and hyper-connections around attention and MLP (decoder-layer hidden states
``[B, S, hc_mult, H]``).

Each decoder layer hands its indexer's top-k to the next (:mod:`.indexer_topk`).

The release's names are transformers' ``hy_v4`` renames (``conversion_mapping.py``) reversed, as ``save_pretrained``
writes them: ``hc_pre.hc_{attn,mlp}_layer.hc_{fn,base,scale}``, ``self_attn.learnable_sink_param``, ``linear_gate``
for every ``gate_proj`` (the attention's output gate and the MLPs'), ``model.hc_pre.hc_head.hc_head_*``.
"""

from __future__ import annotations

import torch

from .deepseek import DeepseekV3Adapter
from .indexer_topk import CarriedIndexerTopK
from .native_names import RuntimeOutsideState, apply_renames, compile_renames
from .swiglu_clamp import OneSwigluLimit
from .vision_language import LanguageModelAtRuntime

_RENAMES = compile_renames(
    (r"\.hc_pre\.hc_", ".hc_"),
    (r"\.learnable_sink_param", ".sinks"),
    (r"\.linear_gate", ".gate_proj"),
    (r"\.hc_attn_layer\.hc_fn", ".attn_hc.fn"),
    (r"\.hc_attn_layer\.hc_base", ".attn_hc.base"),
    (r"\.hc_attn_layer\.hc_scale", ".attn_hc.scale"),
    (r"\.hc_mlp_layer\.hc_fn", ".ffn_hc.fn"),
    (r"\.hc_mlp_layer\.hc_base", ".ffn_hc.base"),
    (r"\.hc_mlp_layer\.hc_scale", ".ffn_hc.scale"),
    (r"\.hc_head_fn", ".hc_fn"),
    (r"\.hc_head_base", ".hc_base"),
    (r"\.hc_head_scale", ".hc_scale"),
)
"""transformers' ``hy_v4`` renames (``conversion_mapping.py``), in its order."""


def runtime_name(name: str) -> str:
    """``name`` (a stored key, or a layer's local key) as the loaded model names it."""
    return apply_renames(_RENAMES, "." + name)[1:]


class HYV4Adapter(OneSwigluLimit, CarriedIndexerTopK, DeepseekV3Adapter):
    family = "hy_v4"
    model_types = ("hy_v4",)
    first_dense_default = 1

    def runtime_local_name(self, local_key: str) -> str:
        return runtime_name(local_key)

    def runtime_outside_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {runtime_name(key): value for key, value in super().runtime_outside_state(state).items()}


class HYV4VLAdapter(RuntimeOutsideState, LanguageModelAtRuntime, HYV4Adapter):
    """HY-V4-VL (``hy_v4_vl``): HY-V4's text model beside a vision tower. On disk the text model keeps the text
    release's names (``model.layers.*``, ``model.embed_tokens``, ``lm_head``) and the vision tower is ``vit.*``;
    transformers places them under ``model.language_model`` and ``model.vision_tower`` at load."""

    family = "hy_v4_vl"
    model_types = ("hy_v4_vl",)
    layers_prefix = "model.layers."

    def is_vision_key(self, key: str) -> bool:
        return key.startswith("vit.")

    def runtime_module_name(self, name: str) -> str:
        if name.startswith("model."):
            return "model.language_model." + runtime_name(name.removeprefix("model."))
        return name
