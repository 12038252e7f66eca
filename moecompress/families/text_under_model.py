"""Releases that keep a wrapper's text model under the text model's own names (``model.layers``,
``model.embed_tokens``, ``model.norm``, ``lm_head``) beside the other towers' top-level or ``model.*`` prefixes, while
transformers builds it as ``model.language_model.*`` (dots.llm3 Note, DeepSeek-OCR-2, Qwen3-Omni's thinker)."""

from __future__ import annotations

from typing import ClassVar

import torch

from .vision_language import TextTowerBesideVision

_DISK, _RUNTIME = "model.", "model.language_model."


class TextUnderModel(TextTowerBesideVision):
    """Mixin, listed before the text family's adapter class; ``vision_prefixes`` are the other towers' names."""

    layers_prefix = "model.layers."
    vision_prefixes: ClassVar[tuple[str, ...]]

    def is_vision_key(self, key: str) -> bool:
        return key.startswith(self.vision_prefixes)

    @property
    def runtime_layers_path(self) -> str:
        return "model.language_model.layers"

    def runtime_module_name(self, name: str) -> str:
        return _RUNTIME + name[len(_DISK) :] if name.startswith(_DISK) else name

    def runtime_outside_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.runtime_module_name(key): value for key, value in state.items() if not self.is_vision_key(key)}
