"""Experts whose SwiGLU is clamped: with one limit (DeepSeek-V4, HY-V4, GLM-5.3-Flash) or a limit per layer
(Step-3.7-Flash, Ling 2.5).

transformers' ``Step3p7Experts._apply_gate`` (``limit_after_act``, which Ling 2.5's experts inherit) computes
``silu(gate).clamp(max=limit) * up.clamp(-limit, limit)`` with layer ``i``'s ``swiglu_limits[i]`` (Ling 2.5's
``config.json`` names the list ``expert_swiglu_limit_list``); a limit of 0 or None, or no list, leaves that layer's
SwiGLU unclamped. The shared experts' limits (``swiglu_limits_shared``) stay with their stock modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ClampedSwiGLU:
    """One layer's expert activation; ``limit`` None is plain SwiGLU (which the fused kernels compute too)."""

    limit: float | None

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is None:
            return F.silu(gate) * up
        return F.silu(gate).clamp(max=self.limit) * up.clamp(min=-self.limit, max=self.limit)


class OneSwigluLimit:
    """Mixin, listed before the family's adapter class: ``silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)``
    with the config's one ``swiglu_limit`` (10 where it has none), the gate clamped before the activation."""

    text_config: dict[str, Any]

    def activation(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        limit = float(self.text_config.get("swiglu_limit", 10.0))
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class PerLayerSwigluClamp:
    """Mixin, listed before the family's adapter class."""

    swiglu_limit_keys: ClassVar[tuple[str, ...]] = ("swiglu_limits", "expert_swiglu_limit_list")
    text_config: dict[str, Any]
    family: str

    def swiglu_limit(self, layer: int) -> float | None:
        """Layer ``layer``'s clamp limit, None where it has none (also for an MTP layer past the list)."""
        cfg = self.text_config
        limits = next((cfg[key] for key in self.swiglu_limit_keys if cfg.get(key) is not None), None)
        if not limits or layer >= len(limits) or not limits[layer]:
            return None
        return float(limits[layer])

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The unclamped SwiGLU (transformers computes ``silu`` whatever ``hidden_act`` the release declares)."""
        return F.silu(gate) * up

    def activation_of(self, layer: int | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        if layer is None:
            if self.activation_varies():
                raise ValueError(f"{self.family}: the experts' SwiGLU clamp depends on the layer, which was not given")
            return ClampedSwiGLU(None)
        return ClampedSwiGLU(self.swiglu_limit(layer))

    def activation_varies(self) -> bool:
        return any(self.swiglu_limit(layer) is not None for layer in self.moe_layers())  # type: ignore[attr-defined]
