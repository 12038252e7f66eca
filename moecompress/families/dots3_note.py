"""dots.llm3 Note's text model (``dots3_note_text``): DeepSeek-V3's MoE block (sigmoid scores plus a correction bias
for the choice, group-limited, renormalised, scaled; per-expert experts on disk; shared experts) in a decoder of MLA
layers with a DSA indexer and sliding-window MLA layers of their own sizes (``per_layer_config``), MoE where
``mlp_layer_types`` says ``sparse``; and its omni release (``dots3_note``)."""

from __future__ import annotations

import torch

from .deepseek import DeepseekV3Adapter
from .vision_language import TextTowerBesideVision


class Dots3NoteTextAdapter(DeepseekV3Adapter):
    family = "dots3_note_text"
    model_types = ("dots3_note_text",)
    first_dense_default = 1


class Dots3NoteAdapter(TextTowerBesideVision, Dots3NoteTextAdapter):
    """The omni release (``dots3_note``, ``Dots3NoteForConditionalGeneration``): that text model under its own names
    (``model.layers``, ``model.embed_tokens``, ``model.norm``, ``lm_head``; ``model.language_model.*`` at runtime)
    beside ``vision_encoder.*`` (a vision tower with MoE layers of its own, passed through untouched like the rest of
    it) and ``audio_encoder.*``."""

    family = "dots3_note"
    model_types = ("dots3_note",)
    layers_prefix = "model.layers."

    def is_vision_key(self, key: str) -> bool:
        return key.startswith(("vision_encoder.", "audio_encoder."))

    @property
    def runtime_layers_path(self) -> str:
        return "model.language_model.layers"

    def runtime_module_name(self, name: str) -> str:
        return "model.language_model." + name[len("model.") :] if name.startswith("model.") else name

    def runtime_outside_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.runtime_module_name(key): value for key, value in state.items() if not self.is_vision_key(key)}
