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

Both ship a multi-token-prediction module as top-level ``mtp.*`` tensors (transformers skips them): ``mtp.fc``,
``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` and full-attention MoE decoder layers
``mtp.layers.{k}``. :class:`TopLevelMtpLayers` numbers those layers ``num_hidden_layers + k``, as DeepSeek-V3
numbers its MTP layers, so calibration, pruning, quantisation and writing treat both styles alike.
"""

from __future__ import annotations

from .base import FamilyAdapter, Layout
from .qwen3_vl_moe import Qwen3VLMoeAdapter
from .qwen_moe import _QwenStyleAdapter


class TopLevelMtpLayers:
    """Mixin, listed before the family's adapter class: ``mtp.layers.{k}.`` is decoder layer ``num_layers + k``."""

    mtp_layers_prefix = "mtp.layers."
    num_layers: int

    def layer_prefix(self, layer: int) -> str:
        if layer >= self.num_layers:
            return f"{self.mtp_layers_prefix}{layer - self.num_layers}."
        return super().layer_prefix(layer)  # type: ignore[misc]

    def layer_of_key(self, key: str) -> int | None:
        if key.startswith(self.mtp_layers_prefix):
            head = key[len(self.mtp_layers_prefix) :].split(".", 1)[0]
            return self.num_layers + int(head) if head.isdigit() else None
        return super().layer_of_key(key)  # type: ignore[misc]


class Qwen3NextAdapter(TopLevelMtpLayers, _QwenStyleAdapter):
    family = "qwen3_next"
    model_types = ("qwen3_next",)


class Qwen3_5MoeTextAdapter(TopLevelMtpLayers, _QwenStyleAdapter):
    family = "qwen3_5_moe_text"
    model_types = ("qwen3_5_moe_text",)


class Qwen3_5MoeAdapter(TopLevelMtpLayers, Qwen3VLMoeAdapter):
    family = "qwen3_5_moe"
    model_types = ("qwen3_5_moe",)
    accepts_images = False

    def detect_layout(self, layer: int, keys) -> Layout:
        return FamilyAdapter.detect_layout(self, layer, keys)
