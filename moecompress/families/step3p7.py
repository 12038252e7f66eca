"""Step-3.7-Flash (``step3p7``; its text config is ``step3p5``, a sub-config): a decoder whose MoE layers
(``mlp_layer_types`` ``sparse``; the release's ``moe_layers_enum``, else every layer from 3 on) route by sigmoid
scores plus a correction bias for the choice, top-k without groups, renormalised; the block multiplies the routed
experts' sum by ``moe_router_scaling_factor`` after them (outside the routed experts' view, as MiniMax-M3's). The
experts' SwiGLU is clamped with a limit per layer (``swiglu_limits``, :mod:`.swiglu_clamp`); the always-active shared
expert beside them keeps its own limits in its stock module. Full and sliding-window attention layers with a
per-head output gate.

On disk (the release's names, which transformers renames at load): the text model under ``model.layers``,
``model.embed_tokens``, ``model.norm`` (``model.language_model.*`` at runtime) beside ``vision_model.*`` and
``vit_large_projector.*``; a MoE layer's experts stacked per matrix, ``moe.gate_proj.weight`` and
``moe.up_proj.weight`` ``[E, I, H]`` (concatenated into ``mlp.experts.gate_up_proj`` at load) and
``moe.down_proj.weight`` ``[E, H, I]``, the router ``moe.gate.weight`` and ``moe.router_bias``
(``mlp.gate.e_score_correction_bias``), the shared expert ``share_expert.*`` (``mlp.shared_experts.*``).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import FamilyAdapter, Layout, MoEWeights
from .block_bias import CorrectionBiasOffRouter
from .routing import RoutingRule
from .swiglu_clamp import PerLayerSwigluClamp
from .text_under_model import TextUnderModel


class Step3p7Adapter(TextUnderModel, PerLayerSwigluClamp, CorrectionBiasOffRouter, FamilyAdapter):
    family = "step3p7"
    model_types = ("step3p7",)
    vision_prefixes = ("vision_model.", "vit_large_projector.")
    moe_disk_prefix = "moe."
    num_experts_keys = ("n_routed_experts", "num_local_experts", "moe_num_experts")
    shared_expert_markers = ("share_expert.",)
    has_correction_bias = True
    correction_bias_key = "moe.router_bias"

    @property
    def top_k(self) -> int:
        cfg = self.text_config
        return int(cfg.get("num_experts_per_tok") or cfg["moe_top_k"])

    def is_moe_layer(self, layer: int) -> bool:
        cfg = self.text_config
        if self.num_experts <= 0:
            return False
        if cfg.get("mlp_layer_types"):
            return cfg["mlp_layer_types"][layer] == "sparse"
        listed = cfg.get("moe_layers_enum")
        if listed is not None:
            items = listed.split(",") if isinstance(listed, str) else listed
            return layer in {int(item) for item in items if str(item).strip()}
        return layer >= 3

    def routing_rule(self) -> RoutingRule:
        return RoutingRule("sigmoid_group_topk", top_k=self.top_k, normalize=True)

    def classify_key(self, key: str) -> Any:
        layer = self.layer_of_key(key)
        if layer is not None:
            local = key[len(self.layer_prefix(layer)) :]
            if local.startswith("moe.") and not local.startswith("moe.gate.") and local != self.correction_bias_key:
                return "experts"
        return super().classify_key(key)

    # ---- the stacked experts ---------------------------------------------------------------------------
    def _stacked_key(self, layer: int, name: str) -> str:
        return f"{self.layer_prefix(layer)}moe.{name}.weight"

    def detect_layout(self, layer: int, keys: set[str] | dict) -> Layout:
        if self._stacked_key(layer, "gate_proj") in keys:
            return "fused"
        raise KeyError(f"layer {layer}: no expert tensors found under {self.layer_prefix(layer)}moe.")

    def _pop_experts(self, layer: int, rest: dict[str, torch.Tensor], layout: Layout) -> MoEWeights:
        gate = rest.pop(self._stacked_key(layer, "gate_proj"))
        up = rest.pop(self._stacked_key(layer, "up_proj"))
        down = rest.pop(self._stacked_key(layer, "down_proj"))
        return MoEWeights(router_weight=torch.empty(0, device="cpu"), gate_up=torch.cat([gate, up], dim=1), down=down)

    def _expert_tensors(self, layer: int, moe: MoEWeights, layout: Layout | None) -> dict[str, torch.Tensor]:
        inter = moe.intermediate_size
        return {
            self._stacked_key(layer, "gate_proj"): moe.gate_up[:, :inter].contiguous(),
            self._stacked_key(layer, "up_proj"): moe.gate_up[:, inter:].contiguous(),
            self._stacked_key(layer, "down_proj"): moe.down,
        }

    def runtime_local_name(self, local_key: str) -> str:
        if local_key.startswith("share_expert."):
            return "mlp.shared_experts." + local_key[len("share_expert.") :]
        return local_key
