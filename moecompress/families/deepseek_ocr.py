"""DeepSeek-OCR-2 (``deepseek_ocr2``): a DeepSeek-V2-style MoE text model (multi-head attention, no MLA; softmax
router, greedy or group-limited greedy top-k, weights not renormalised, scaled by ``routed_scaling_factor``; per-expert
experts on disk; shared experts; MoE where ``mlp_layer_types`` says ``sparse``) behind a SAM and a second vision
encoder. Its release keeps the text model under its own names beside ``model.sam_model``, ``model.qwen2_model``,
``model.projector`` and ``model.view_seperator``."""

from __future__ import annotations

from .deepseek import DeepseekV2Adapter
from .text_under_model import TextUnderModel


class DeepseekOcr2Adapter(TextUnderModel, DeepseekV2Adapter):
    family = "deepseek_ocr2"
    model_types = ("deepseek_ocr2",)
    vision_prefixes = ("model.sam_model.", "model.qwen2_model.", "model.projector.", "model.view_seperator")
