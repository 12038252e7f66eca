"""Kimi-K2.5 (``kimi_k25``): Kimi-K2 (DeepSeek-V3's decoder, ``text_config`` with ``model_type: kimi_k2``) beside a
MoonViT vision tower, in the release's names: ``language_model.model.layers.*`` and ``language_model.lm_head``, which
transformers renames to ``model.language_model.*`` and ``lm_head`` at load, and ``vision_tower.encoder.*`` /
``mm_projector.*``, passed through untouched. Calibrated on text: the skeleton that embeds tokens and computes the
logits is built without the vision tower's weights (transformers splits its fused ``wqkv`` at load; text never
reaches it).
"""

from __future__ import annotations

import torch

from .deepseek import DeepseekV3Adapter
from .vision_language import TextTowerBesideVision

_RUNTIME_PREFIXES = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "mm_projector.", "model.mm_projector.", "model.vision_tower.")


class KimiK25Adapter(TextTowerBesideVision, DeepseekV3Adapter):
    family = "kimi_k25"
    model_types = ("kimi_k25",)
    layers_prefix = "language_model.model.layers."

    def is_vision_key(self, key: str) -> bool:
        return key.startswith(_VISION_PREFIXES)

    @property
    def runtime_layers_path(self) -> str:
        return "model.language_model.layers"

    def runtime_module_name(self, name: str) -> str:
        for disk, runtime in _RUNTIME_PREFIXES:
            if name.startswith(disk):
                return runtime + name[len(disk) :]
        return name

    def runtime_outside_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.runtime_module_name(key): value for key, value in state.items() if not self.is_vision_key(key)}
