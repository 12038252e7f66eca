"""Gemma 4 (``gemma4_text``; the release ``gemma4`` holds it as ``text_config`` beside vision and audio towers).

A Gemma 4 MoE decoder layer (``enable_moe_block``) has no MoE block module: its ``router`` and ``experts`` sit in the
layer beside the dense ``mlp``, whose output they are added to. The router reads the residual stream through a norm
and scale of its own (``router.norm``, ``router.scale``, then ``router.proj``); the experts read
``pre_feedforward_layernorm_2`` of it. The router's rule is softmax, top-k, renormalised, and each chosen weight is then
multiplied by ``router.per_expert_scale`` of its expert (the view's ``expert_scale``). The sweep captures the router's
input at ``router.proj`` and the experts' at ``experts``, so the stock modules compute both; the MoE output the passes
measure is the experts module's (scaled) output, before ``post_feedforward_layernorm_2``.

transformers has no conversion rule for Gemma 4: the release stores what the modules hold (``experts.gate_up_proj``
``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``), the text model under ``model.language_model`` in ``gemma4``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..errors import UserInputError
from .base import FamilyAdapter, ParamClass
from .vision_language import TextTowerBesideVision


class Gemma4TextAdapter(FamilyAdapter):
    family = "gemma4_text"
    model_types = ("gemma4_text",)
    moe_disk_prefix = ""
    router_module = "router"
    router_key = "router"
    expert_scale_name = "per_expert_scale"
    router_input_module = "router.proj"
    num_experts_keys = ("num_experts",)
    shared_expert_markers = ()

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        shared = int(self.text_config.get("num_kv_shared_layers") or 0)
        if shared and self.num_experts > 0:
            raise UserInputError(
                f"{self.family}: num_kv_shared_layers {shared}: those layers reuse an earlier layer's keys and values, "
                "which the layer-by-layer sweep does not carry between layers; only 0 (the MoE release's) is supported"
            )

    @property
    def num_experts(self) -> int:
        if not self.text_config.get("enable_moe_block"):
            return 0
        return super().num_experts

    @property
    def top_k(self) -> int:
        return int(self.text_config["top_k_experts"])

    @property
    def moe_block_name(self) -> str:
        return ""

    @property
    def experts_module(self) -> str:
        return "experts"

    @property
    def moe_site_module(self) -> str:
        return "experts"

    def fix_skeleton(self, skeleton: torch.nn.Module) -> None:
        """The text model slices its inputs to ``logits_to_keep`` at its first KV-sharing layer, an index it computes
        from the layer count (0 in the skeleton): set it from the config's."""
        text_model = skeleton.get_submodule(self.runtime_layers_path.rpartition(".")[0])
        shared = int(self.text_config.get("num_kv_shared_layers") or 0)
        text_model.first_kv_shared_layer_idx = self.num_layers - shared

    def activation(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        act = self.text_config.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"{self.family}: unsupported expert activation {act!r}")
        return F.gelu(gate, approximate="tanh") * up

    def _router_key(self, layer: int, name: str) -> str:
        if name in ("weight", "bias"):
            return f"{self.layer_prefix(layer)}router.proj.{name}"
        return super()._router_key(layer, name)

    def classify_key(self, key: str) -> ParamClass:
        layer = self.layer_of_key(key)
        if layer is not None and key[len(self.layer_prefix(layer)) :].startswith("router."):
            return "router"
        return super().classify_key(key)

    def runtime_router_state(self, moe) -> dict[str, torch.Tensor]:
        state = {"router.proj.weight": moe.router_weight}
        if moe.expert_scale is not None:
            state[f"router.{self.expert_scale_name}"] = moe.expert_scale
        return state

    def reroute_hooks(self, layer_module: torch.nn.Module, choose) -> list[Any]:
        """The router returns softmax probabilities, not logits: the logits are taken from ``router.proj``."""
        logits: list[torch.Tensor] = []

        def keep_logits(proj, inputs, output):
            logits[:] = [output]

        def reroute(router, inputs, output):
            ids, weights = choose(logits.pop())
            return self.with_route(output, weights, ids)

        return [
            layer_module.get_submodule("router.proj").register_forward_hook(keep_logits),
            layer_module.get_submodule("router").register_forward_hook(reroute),
        ]


class Gemma4Adapter(TextTowerBesideVision, Gemma4TextAdapter):
    """The release: ``model.language_model`` beside ``model.vision_tower`` / ``model.audio_tower`` and their
    embedders (passed through untouched); calibrated on text."""

    family = "gemma4"
    model_types = ("gemma4",)
    _VISION_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")

    def is_vision_key(self, key: str) -> bool:
        return key.startswith(self._VISION_PREFIXES)
