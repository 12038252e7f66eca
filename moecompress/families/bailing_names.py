"""The Ling/Bailing release names (Ling 2.5, Sarvam-30B, Param-2), which transformers renames at load."""

from __future__ import annotations

from typing import Any

import torch

_EMBEDDINGS = "model.word_embeddings."


class BailingNames:
    """Mixin, listed before the adapter class: ``model.word_embeddings`` is ``model.embed_tokens`` at runtime, and a
    layer's ``attention.*`` tensors (``self_attn.*`` at runtime) are attention."""

    def classify_key(self, key: str) -> Any:
        if key.startswith(_EMBEDDINGS):
            return "embeddings"
        layer = self.layer_of_key(key)
        if layer is not None and key[len(self.layer_prefix(layer)) :].startswith("attention."):
            return "attention"
        return super().classify_key(key)

    def runtime_outside_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            ("model.embed_tokens." + key[len(_EMBEDDINGS) :] if key.startswith(_EMBEDDINGS) else key): value
            for key, value in state.items()
        }
