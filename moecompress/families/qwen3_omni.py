"""Qwen3-Omni's release (``qwen3_omni_moe``, ``Qwen3OmniMoeForConditionalGeneration``): a thinker (Qwen3-MoE text
model beside an audio and a vision tower) and a talker (a Qwen2-MoE-style codec decoder with a code predictor) plus a
code2wav vocoder. The release class has no forward (it only generates), so moecompress builds the thinker alone
(``Qwen3OmniMoeThinkerForConditionalGeneration`` from ``thinker_config``; transformers loads it from the release's
directory, dropping the ``thinker.`` prefix) and compresses the thinker's decoder layers
(``thinker.model.layers.*``, ``model.language_model.layers.*`` at runtime).

The talker's MoE layers are passed through unchanged, as are ``thinker.audio_tower.*``, ``thinker.visual.*`` and
``code2wav.*``: the talker reads the thinker's hidden states and codec tokens, not text, so text calibration does not
reach it."""

from __future__ import annotations

from typing import Any

from .base import ParamClass
from .qwen_moe import Qwen3MoeAdapter
from .vision_language import RenamedTextTower

_SPEECH = ("talker.", "code2wav.")
"""The speech decoder and vocoder: passed through, counted as "other" (not a vision tower) in footprints."""


class Qwen3OmniMoeAdapter(RenamedTextTower, Qwen3MoeAdapter):
    family = "qwen3_omni_moe"
    model_types = ("qwen3_omni_moe",)
    head_pruning = False
    layers_prefix = "thinker.model.layers."
    runtime_prefixes = (("thinker.model.", "model.language_model."), ("thinker.lm_head.", "lm_head."))
    vision_prefixes = ("thinker.audio_tower.", "thinker.visual.", *_SPEECH)

    @property
    def text_config(self) -> dict[str, Any]:
        return self.config["thinker_config"]["text_config"]

    def _text_section(self, config: dict[str, Any]) -> dict[str, Any]:
        return config["thinker_config"]["text_config"]

    def classify_key(self, key: str) -> ParamClass:
        return "other" if key.startswith(_SPEECH) else super().classify_key(key)

    def transformers_config(self) -> Any:
        from transformers import AutoConfig

        thinker = {key: value for key, value in self.config["thinker_config"].items() if key != "model_type"}
        if "quantization_config" in self.config:  # the release's, for the thinker alone to load through the plugin
            thinker["quantization_config"] = self.config["quantization_config"]
        return AutoConfig.for_model("qwen3_omni_moe_thinker", **thinker)
