"""What every vision-language release shares: the MoE text tower under ``model.language_model`` with its config
in ``text_config``, beside a vision tower ``model.visual`` that is passed through untouched."""

from __future__ import annotations

from typing import Any


class TextTowerBesideVision:
    """Mixin, listed before the text family's adapter class."""

    config: dict[str, Any]
    auto_class = "AutoModelForImageTextToText"
    layers_prefix = "model.language_model.layers."

    @property
    def text_config(self) -> dict[str, Any]:
        return self.config["text_config"]

    def _text_section(self, config: dict[str, Any]) -> dict[str, Any]:
        return config["text_config"]

    def is_vision_key(self, key: str) -> bool:
        return key.startswith("model.visual.")
