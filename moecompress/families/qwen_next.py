"""Qwen3-Next and Qwen3.5-MoE: Qwen-style routing (softmax, top-k, renormalised) with a sigmoid-gated shared expert
(``mlp.shared_expert`` and ``mlp.shared_expert_gate``, left untouched by expert passes), in a hybrid decoder whose
layers are Gated DeltaNet linear attention (``linear_attn``) or gated full attention (``self_attn``), as
``layer_types`` says.

Qwen3-Next releases store the experts per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``). Qwen3.5-MoE
releases are the vision-language wrapper (``model_type: qwen3_5_moe``, text tower under ``model.language_model``,
vision tower ``model.visual``) with the experts fused in the transformers runtime orientation
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``); its text-only form
(``qwen3_5_moe_text``) is what ``save_pretrained`` of ``Qwen3_5MoeForCausalLM`` writes, per expert. Both layouts are
read and written back as found.
"""

from __future__ import annotations

from .base import FamilyAdapter, Layout
from .qwen3_vl_moe import Qwen3VLMoeAdapter
from .qwen_moe import _QwenStyleAdapter


class Qwen3NextAdapter(_QwenStyleAdapter):
    family = "qwen3_next"
    model_types = ("qwen3_next",)


class Qwen3_5MoeTextAdapter(_QwenStyleAdapter):
    family = "qwen3_5_moe_text"
    model_types = ("qwen3_5_moe_text",)


class Qwen3_5MoeAdapter(Qwen3VLMoeAdapter):
    family = "qwen3_5_moe"
    model_types = ("qwen3_5_moe",)
    accepts_images = False

    def detect_layout(self, layer: int, keys) -> Layout:
        return FamilyAdapter.detect_layout(self, layer, keys)
