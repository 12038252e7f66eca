"""Unlimited-OCR (``unlimited_ocr``): DeepSeek-OCR-2's MoE text model and release layout (text under ``model.layers``
beside ``model.sam_model``, ``model.vision_model``, ``model.projector``, ``model.view_seperator`` and
``model.image_newline``) whose decoder layers use reference sliding-window attention: a token sees the last
``sliding_window`` tokens and every prefill token, so a single forward over a window is causal over all of it."""

from __future__ import annotations

from .deepseek_ocr import DeepseekOcr2Adapter


class UnlimitedOcrAdapter(DeepseekOcr2Adapter):
    family = "unlimited_ocr"
    model_types = ("unlimited_ocr",)
    vision_prefixes = (
        "model.sam_model.",
        "model.vision_model.",
        "model.projector.",
        "model.view_seperator",
        "model.image_newline",
    )
