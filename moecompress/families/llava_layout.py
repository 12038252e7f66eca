"""The on-disk layout of llava-style vision-language releases (Mistral 3/4, MiniMax-M3): the text model under
``language_model.model.*`` and its head ``language_model.lm_head``, the vision weights at the top level; transformers
renames the text names to ``model.language_model.*`` and ``lm_head`` at load. Calibrated on text: the skeleton that
embeds tokens and computes the logits is built without the vision weights."""

from __future__ import annotations

from .vision_language import RenamedTextTower


class LlavaLayout(RenamedTextTower):
    """Mixin, listed before the text family's adapter class; ``vision_prefixes`` are the vision weights' names."""

    layers_prefix = "language_model.model.layers."
    runtime_prefixes = (
        ("language_model.model.", "model.language_model."),
        ("language_model.lm_head.", "lm_head."),
    )
