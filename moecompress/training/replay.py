"""Recording a model's routes and replaying them in another model's forward.

Both work through forward hooks on each MoE layer's router, whose output in every supported family is
``(logits, weights, top-k ids)`` and whose ids and weights the MoE block hands to its experts. A hook that
returns a different tuple changes what the experts receive, and nothing else: the router's own computation
(and its parameters) are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import OptionError, UserInputError
from ..families import FamilyAdapter
from ..vocabulary import named

REPLAY_WEIGHTS: tuple[str, ...] = ("router", "recorded")


@dataclass(frozen=True)
class ReplaySchedule:
    """When the recorded routes replace the model's own: ``all`` steps, ``none``, the ``first:F`` fraction of
    the steps, or ``layers:3,5`` (those MoE layers, every step)."""

    fraction: float = 1.0
    layers: tuple[int, ...] | None = None

    @classmethod
    def parse(cls, text: str) -> ReplaySchedule:
        text = text.strip()
        if text == "all":
            return cls(1.0)
        if text == "none":
            return cls(0.0)
        kind, _, value = text.partition(":")
        try:
            if kind == "first":
                fraction = float(value)
                if not 0.0 <= fraction <= 1.0:
                    raise ValueError
                return cls(fraction)
            if kind == "layers":
                layers = tuple(sorted({int(v) for v in value.split(",") if v.strip()}))
                if not layers:
                    raise ValueError
                return cls(1.0, layers)
        except ValueError:
            pass
        raise UserInputError(f"replay schedule {text!r}: use all, none, first:F (0 <= F <= 1) or layers:L1,L2,...")

    def describe(self) -> str:
        if self.layers is not None:
            return "layers:" + ",".join(map(str, self.layers))
        return {1.0: "all", 0.0: "none"}.get(self.fraction, f"first:{self.fraction:g}")

    def check_layers(self, moe_layers: list[int]) -> None:
        unknown = sorted(set(self.layers or ()) - set(moe_layers))
        if unknown:
            raise OptionError(
                f"{named('replay', self.describe())}: layers {unknown} are not MoE layers; the MoE layers are "
                f"{moe_layers}"
            )

    def layers_at(self, step: int, steps: int, moe_layers: list[int]) -> set[int]:
        """The MoE layers whose routes are replayed at ``step`` (0-based) of ``steps``."""
        if self.layers is not None:
            return set(self.layers)
        return set(moe_layers) if step < round(self.fraction * steps) else set()


def _passes(adapter: FamilyAdapter, layer: int) -> int:
    """How many times one forward calls layer ``layer``'s router (a looped layer's: once per pass)."""
    return adapter.loop_passes if layer in adapter.loop_layers else 1


class RouteCapture:
    """After each forward, ``routes[layer]`` is ``(ids [T, k], weights [T, k])`` as the router chose them (a looped
    layer's every pass, one after the other: ``[passes · T, k]``)."""

    def __init__(self, model: torch.nn.Module, adapter: FamilyAdapter):
        self.routes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._adapter = adapter
        self._handles = [
            adapter.router_of(model, layer).register_forward_hook(self._hook(layer)) for layer in adapter.moe_layers()
        ]

    def _hook(self, layer: int):
        passes, calls = _passes(self._adapter, layer), [0]

        def record(module, inputs, output):
            _, weights, ids = self._adapter.route_of(output)
            ids, weights = ids.detach(), weights.detach()
            if calls[0] % passes:
                ids = torch.cat([self.routes[layer][0], ids])
                weights = torch.cat([self.routes[layer][1], weights])
            calls[0] += 1
            self.routes[layer] = (ids, weights)

        return record

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class RouteReplay:
    """Replaces the routes of the layers in :attr:`active` by :attr:`routes` (set before each forward).

    ``weights="router"`` recomputes the replayed experts' weights from this model's own (frozen) router logits
    with the family's rule, so the mixing weights still follow the hidden states; ``"recorded"`` uses the
    recorded weights as they are. Layers not active route freely.
    """

    def __init__(self, model: torch.nn.Module, adapter: FamilyAdapter, weights: str = "router"):
        if weights not in REPLAY_WEIGHTS:
            raise OptionError(f"{named('replay_weights', weights)}: choose from {', '.join(REPLAY_WEIGHTS)}")
        self.weights = weights
        self.adapter = adapter
        self.rule = adapter.routing_rule()
        self.routes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.active: set[int] = set()
        self.own_ids: dict[int, torch.Tensor] = {}
        """Per layer, the ids this model's router chose in the last forward, replayed or not."""
        self._handles = [
            adapter.router_of(model, layer).register_forward_hook(self._hook(layer)) for layer in adapter.moe_layers()
        ]

    def _hook(self, layer: int):
        passes, calls = _passes(self.adapter, layer), [0]

        def replace(module, inputs, output):
            logits, _, own_ids = self.adapter.route_of(output)
            step, calls[0] = calls[0] % passes, calls[0] + 1
            own = own_ids.detach()
            self.own_ids[layer] = torch.cat([self.own_ids[layer], own]) if step else own
            if layer not in self.active:
                return None
            rows = slice(step * own_ids.shape[0], (step + 1) * own_ids.shape[0])
            ids, recorded = (route[rows].to(own_ids.device) for route in self.routes[layer])
            if ids.shape != own_ids.shape:
                raise RuntimeError(f"layer {layer}: recorded routes {tuple(ids.shape)} vs {tuple(own_ids.shape)}")
            weights = recorded if self.weights == "recorded" else self.rule.weights_for(logits, ids)
            return self.adapter.with_route(output, weights, ids)

        return replace

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
