"""Nemotron 3 Nano Omni (``nemotron_h_omni``): a Nemotron-H text model (``text_config``, :class:`NemotronHAdapter`)
as ``language_model`` beside a RADIO vision tower, an optional Parakeet audio tower and their projectors. On disk the
text model keeps Nemotron-H's own names under ``language_model.`` (``language_model.backbone.layers.{i}.mixer.*``,
``language_model.backbone.embeddings``, ``language_model.lm_head``); transformers renames ``backbone.`` to ``model.``
at load. Everything outside ``language_model.`` (``vision_model``, ``mlp1``, ``sound_encoder``, ``sound_projection``,
...) is passed through untouched."""

from __future__ import annotations

from .native_names import RuntimeOutsideState
from .nemotron_h import NemotronHAdapter
from .vision_language import TextTowerBesideVision

_TEXT = "language_model."


class NemotronHOmniAdapter(RuntimeOutsideState, TextTowerBesideVision, NemotronHAdapter):
    family = "nemotron_h_omni"
    model_types = ("nemotron_h_omni",)
    layers_prefix = "language_model.backbone.layers."
    embeddings_prefix = "language_model.backbone.embeddings."

    def is_vision_key(self, key: str) -> bool:
        return not key.startswith(_TEXT)

    @property
    def runtime_layers_path(self) -> str:
        return "language_model.model.layers"

    def runtime_module_name(self, name: str) -> str:
        if name.startswith(_TEXT):
            return _TEXT + super().runtime_module_name(name[len(_TEXT) :])
        return name
