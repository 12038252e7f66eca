"""Kimi-K2.5 (``kimi_k25``): Kimi-K2 (DeepSeek-V3's decoder) beside a MoonViT vision tower, in either of two layouts:

- the release's: ``text_config`` with ``model_type: kimi_k2``, decoder layers ``language_model.model.layers.*``;
- what ``save_pretrained`` of the stock ``Kimi_K25ForConditionalGeneration`` writes: ``text_config`` with
  ``model_type: deepseek_v3`` and ``language_model.model.blocks.*`` (transformers' load rules rename the vision
  tower's ``blocks`` to ``layers`` in every key, and saving reverses that on every key).

Both keep ``language_model.lm_head`` and the vision weights ``vision_tower.*`` / ``mm_projector.*`` (passed through
untouched); transformers renames the text names to ``model.language_model.layers.*`` and ``lm_head`` at load.
Calibrated on text: the skeleton that embeds tokens and computes the logits is built without the vision tower's
weights (transformers splits its fused ``wqkv`` at load; text never reaches it).
"""

from __future__ import annotations

from .deepseek import DeepseekV3Adapter
from .vision_language import RenamedTextTower

_RELEASE_LAYERS = "language_model.model.layers."
_SAVED_LAYERS = "language_model.model.blocks."
_SAVED_TEXT_MODEL_TYPE = "deepseek_v3"
"""The text config's ``model_type`` in what ``save_pretrained`` writes (its text config class is DeepSeek-V3's)."""
_RUNTIME_PREFIXES = (
    (_RELEASE_LAYERS, "model.language_model.layers."),
    (_SAVED_LAYERS, "model.language_model.layers."),
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = ("vision_tower.", "mm_projector.", "model.mm_projector.", "model.vision_tower.")


class KimiK25Adapter(RenamedTextTower, DeepseekV3Adapter):
    family = "kimi_k25"
    model_types = ("kimi_k25",)
    runtime_prefixes = _RUNTIME_PREFIXES
    vision_prefixes = _VISION_PREFIXES

    @property
    def layers_prefix(self) -> str:
        saved = self.text_config.get("model_type") == _SAVED_TEXT_MODEL_TYPE
        return _SAVED_LAYERS if saved else _RELEASE_LAYERS
