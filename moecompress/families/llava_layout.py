"""The on-disk layout of llava-style vision-language releases (Mistral 3/4, MiniMax-M3): the text model under
``language_model.model.*`` and its head ``language_model.lm_head``, the vision weights at the top level; transformers
renames the text names to ``model.language_model.*`` and ``lm_head`` at load. Calibrated on text: the skeleton that
embeds tokens and computes the logits is built without the vision weights."""

from __future__ import annotations

from typing import ClassVar

import torch

from .vision_language import TextTowerBesideVision

_RUNTIME_PREFIXES = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
)


class LlavaLayout(TextTowerBesideVision):
    """Mixin, listed before the text family's adapter class."""

    layers_prefix = "language_model.model.layers."
    vision_prefixes: ClassVar[tuple[str, ...]]

    def is_vision_key(self, key: str) -> bool:
        return key.startswith(self.vision_prefixes)

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
