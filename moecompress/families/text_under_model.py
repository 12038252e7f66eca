"""Releases that keep a wrapper's text model under the text model's own names (``model.layers``,
``model.embed_tokens``, ``model.norm``, ``lm_head``) beside the other towers' top-level or ``model.*`` prefixes, while
transformers builds it as ``model.language_model.*`` (dots.llm3 Note, DeepSeek-OCR-2, Qwen3-Omni's thinker)."""

from __future__ import annotations

from .vision_language import RenamedTextTower


class TextUnderModel(RenamedTextTower):
    """Mixin, listed before the text family's adapter class; ``vision_prefixes`` are the other towers' names."""

    layers_prefix = "model.layers."
    runtime_prefixes = (("model.", "model.language_model."),)
