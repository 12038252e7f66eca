"""What every vision-language release shares: the MoE text tower under ``model.language_model`` with its config
in ``text_config``, beside a vision tower ``model.visual`` that is passed through untouched."""

from __future__ import annotations

from typing import Any, ClassVar

from .native_names import RuntimeOutsideState, with_runtime_prefix


class TextConfigSection:
    """Mixin, listed before the text family's adapter class: the decoder's config is the ``text_config`` section."""

    config: dict[str, Any]

    @property
    def text_config(self) -> dict[str, Any]:
        return self.config["text_config"]

    def _text_section(self, config: dict[str, Any]) -> dict[str, Any]:
        return config["text_config"]


class LanguageModelAtRuntime(TextConfigSection):
    """Mixin, listed before the text family's adapter class, for releases whose text model transformers builds as
    ``model.language_model`` beside the other towers, whatever names the release stores it under."""

    auto_class = "AutoModelForImageTextToText"

    @property
    def runtime_layers_path(self) -> str:
        return "model.language_model.layers"


class TextTowerBesideVision(TextConfigSection):
    """Mixin, listed before the text family's adapter class."""

    auto_class = "AutoModelForImageTextToText"
    layers_prefix = "model.language_model.layers."

    def is_vision_key(self, key: str) -> bool:
        return key.startswith("model.visual.")


class RenamedTextTower(RuntimeOutsideState, LanguageModelAtRuntime, TextTowerBesideVision):
    """Mixin for releases whose text tower is stored under other names than transformers builds: each name starting
    with a ``runtime_prefixes`` disk prefix takes its runtime prefix (the first that matches), and the keys under
    ``vision_prefixes`` are the other towers' (passed through untouched)."""

    runtime_prefixes: ClassVar[tuple[tuple[str, str], ...]]
    vision_prefixes: ClassVar[tuple[str, ...]]

    def is_vision_key(self, key: str) -> bool:
        return key.startswith(self.vision_prefixes)

    def runtime_module_name(self, name: str) -> str:
        return with_runtime_prefix(self.runtime_prefixes, name)
