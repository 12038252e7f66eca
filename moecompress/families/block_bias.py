"""Families whose checkpoints store the routing correction bias on the MoE block (or a statistics module beside the
router) rather than under the router, where transformers moves it at load."""

from __future__ import annotations

from typing import Any


class CorrectionBiasOffRouter:
    """Mixin, listed before the adapter class: ``e_score_correction_bias`` is read from and written to
    ``{layer prefix}{correction_bias_key}`` and classified as a router tensor."""

    correction_bias_key: str

    def _router_key(self, layer: int, name: str) -> str:
        if name == "e_score_correction_bias":
            return f"{self.layer_prefix(layer)}{self.correction_bias_key}"  # type: ignore[attr-defined]
        return super()._router_key(layer, name)  # type: ignore[misc]

    def classify_key(self, key: str) -> Any:
        return "router" if key.endswith(self.correction_bias_key) else super().classify_key(key)  # type: ignore[misc]
