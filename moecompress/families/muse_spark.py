"""Muse Spark (``muse_spark``): a vision-, audio- and text-to-text release whose MoE blocks run their experts in a
latent space.

Each ``mlp`` of a ``sparse`` layer (``text_config.mlp_layer_types``; ``dense`` layers hold a SwiGLU MLP) routes the
block's input (``mlp.gate``: sigmoid of the logits times ``output_multiplier``, the choice on the scores plus
``mlp.gate.e_score_correction_bias``, no groups, renormalised with 1e-15 added to the sum, times
``routed_scaling_factor``), maps it to ``moe_hidden_size`` (``mlp.pre_expert_proj``, then the centred RMS norm
``mlp.pre_expert_norm``) for the SwiGLU experts (fused ``mlp.experts.gate_up_proj`` ``[E, 2I, L]``,
``down_proj`` ``[E, L, I]``), normalises each expert's output with ``mlp.experts.post_expert_norm`` (one weight
``[L]`` shared by every expert: scale by ``1 + w``, then RMS-normalise) before its routing weight, and maps the sum
back (``mlp.post_expert_proj``). The view holds the experts in the latent space
(:attr:`~moecompress.families.base.FamilyAdapter.latent_experts`) and the shared norm weight as
:attr:`~moecompress.families.base.MoEWeights.output_norm`, which also stays a layer tensor (written as read, never
pruned or quantised).

transformers has no conversion rule for Muse Spark, so its release holds the modules' own names (what
``save_pretrained`` of ``MuseSparkForConditionalGeneration`` writes): the text model under
``model.language_model``, beside ``model.vision_tower``, ``model.vision_adapter``, ``model.vision_projection`` and
``model.audio_tower`` (passed through untouched; calibration is text only), and ``lm_head``.
"""

from __future__ import annotations

import torch

from .base import FamilyAdapter, Layout, MoEWeights, ParamClass
from .routing import RoutingRule
from .vision_language import TextTowerBesideVision


class MuseSparkAdapter(TextTowerBesideVision, FamilyAdapter):
    family = "muse_spark"
    model_types = ("muse_spark",)
    num_experts_keys = ("num_local_experts",)
    has_correction_bias = True
    shared_expert_markers = ()
    latent_size_key = "moe_hidden_size"
    expert_output_norm = "post_expert_norm"
    _VISION_PREFIXES = (
        "model.vision_tower.",
        "model.vision_adapter.",
        "model.vision_projection.",
        "model.audio_tower.",
    )

    def is_vision_key(self, key: str) -> bool:
        return key.startswith(self._VISION_PREFIXES)

    def is_moe_layer(self, layer: int) -> bool:
        return self.listed_moe_layer(layer, True)

    def routing_rule(self) -> RoutingRule:
        return RoutingRule(
            "sigmoid_group_topk",
            top_k=self.top_k,
            normalize=True,
            scaling=float(self.text_config.get("routed_scaling_factor", 1.0)),
            norm_eps=1e-15,
        )

    def router_logits(self, moe: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        return super().router_logits(moe, hidden) * float(self.text_config.get("output_multiplier", 1.0))

    def expert_output(self, moe: MoEWeights, expert: int, hidden: torch.Tensor) -> torch.Tensor:
        """The SwiGLU expert's output through the shared ``post_expert_norm``, as the stock experts module computes
        it (in float32, then back to the input's dtype)."""
        out = super().expert_output(moe, expert, hidden)
        scaled = (out.float() * (1.0 + moe.output_norm.float())).to(out.dtype).float()
        eps = float(self.text_config.get("post_norm_eps", 1e-8))
        return (scaled * torch.rsqrt(scaled.pow(2).mean(-1, keepdim=True) + eps)).to(out.dtype)

    def _norm_key(self, layer: int) -> str:
        return f"{self.layer_prefix(layer)}{self.moe_disk_prefix}experts.{self.expert_output_norm}.weight"

    def split_layer(
        self, layer: int, tensors: dict[str, torch.Tensor], *, consume: bool = False
    ) -> tuple[MoEWeights | None, dict[str, torch.Tensor], Layout | None]:
        moe, rest, layout = super().split_layer(layer, tensors, consume=consume)
        if moe is not None:
            moe.output_norm = rest[self._norm_key(layer)]
        return moe, rest, layout

    def classify_key(self, key: str) -> ParamClass:
        layer = self.layer_of_key(key)
        if layer is not None and key == self._norm_key(layer):
            return "norms"
        return super().classify_key(key)
