"""Families whose MoE block and router are DeepSeek-V3's (sigmoid scores, ``e_score_correction_bias``, group-limited
top-k, renormalised, scaled; shared experts; the first layers dense), with their own attention.

On disk all of them keep DeepSeek-V3's names: ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
``mlp.experts.{e}.{gate,up,down}_proj.weight``, ``mlp.shared_experts.*``.

- GLM-4.5/4.6/4.7 (``glm4_moe``): grouped-query attention with ``head_dim``, q/k/v biases, optional q/k norms.
- GLM-4.7-Flash (``glm4_moe_lite``) and DeepSeek-V3.2 (``deepseek_v32``, with its sparse-attention indexer): MLA.
- dots.llm1 (``dots1``): grouped-query attention with per-head q/k norms.
- Kimi-K2 (``kimi_k2``): DeepSeek-V3 itself; its ``config.json`` names a model type transformers does not know and an
  ``auto_map`` into the release's own Python. That code is never run: the config is read as DeepSeek-V3's and the
  model built from that config (``DeepseekV3ForCausalLM``, which the release's ``architectures`` names).
- GLM-5 (``glm_moe_dsa``): MLA with DeepSeek-V3.2's sparse-attention indexer; each decoder layer hands its indexer's
  top-k to the next (:mod:`.indexer_topk`).
- MiniCPM-5 MoE (``minicpm5_moe``): grouped-query attention whose query projection also holds a per-head output gate
  (on disk ``self_attn.q_proj``, ``self_attn.q_gate_proj`` at runtime); ``mlp_layer_types``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .base import FamilyAdapter
from .block_bias import CorrectionBiasOffRouter
from .deepseek import DeepseekV3Adapter
from .indexer_topk import CarriedIndexerTopK
from .routing import RoutingRule
from .vision_language import TextTowerBesideVision


class _GroupedQueryAttentionAdapter(DeepseekV3Adapter):
    """DeepSeek-V3's routing with ordinary (grouped-query) attention instead of MLA."""

    def head_counts(self) -> tuple[int, int, int]:
        return FamilyAdapter.head_counts(self)


class Glm4MoeAdapter(_GroupedQueryAttentionAdapter):
    family = "glm4_moe"
    model_types = ("glm4_moe",)


class Glm4MoeLiteAdapter(DeepseekV3Adapter):
    family = "glm4_moe_lite"
    model_types = ("glm4_moe_lite",)
    first_dense_default = 1


class DeepseekV32Adapter(DeepseekV3Adapter):
    family = "deepseek_v32"
    model_types = ("deepseek_v32",)
    first_dense_default = 3


class Dots1Adapter(_GroupedQueryAttentionAdapter):
    family = "dots1"
    model_types = ("dots1",)


class KimiK2Adapter(DeepseekV3Adapter):
    family = "kimi_k2"
    model_types = ("kimi_k2",)

    def transformers_config(self) -> Any:
        from transformers import DeepseekV3Config

        fields = {key: value for key, value in self.config.items() if key not in ("model_type", "auto_map")}
        return DeepseekV3Config.from_dict(fields)


class GlmMoeDsaAdapter(CarriedIndexerTopK, DeepseekV3Adapter):
    family = "glm_moe_dsa"
    model_types = ("glm_moe_dsa",)
    first_dense_default = 3


class MiniCPM5MoeAdapter(_GroupedQueryAttentionAdapter):
    family = "minicpm5_moe"
    model_types = ("minicpm5_moe",)
    first_dense_default = 1

    def runtime_local_name(self, local_key: str) -> str:
        return local_key.replace("self_attn.q_proj.", "self_attn.q_gate_proj.", 1)


class SarvamMlaAdapter(DeepseekV3Adapter):
    """Sarvam-105B (``sarvam_mla``): DeepSeek-V3 itself (transformers builds ``DeepseekV3ForCausalLM``; its config
    class translates the release's remote-code keys)."""

    family = "sarvam_mla"
    model_types = ("sarvam_mla",)
    first_dense_default = 1


class MiMoV2FlashAdapter(_GroupedQueryAttentionAdapter):
    """MiMo-V2-Flash (``mimo_v2_flash``): DeepSeek-V3's router without shared experts; grouped-query attention with
    sliding/full layers and attention sinks (``self_attn.attention_sink_bias`` on disk, ``self_attn.sinks`` at
    runtime). Without ``mlp_layer_types`` transformers makes the first layer dense and the rest MoE, and reads a null
    ``routed_scaling_factor`` (as the release stores it) as 1."""

    family = "mimo_v2_flash"
    model_types = ("mimo_v2_flash",)

    def is_moe_layer(self, layer: int) -> bool:
        return self.listed_moe_layer(layer, layer >= 1)

    def routing_rule(self) -> RoutingRule:
        cfg = self.text_config
        return RoutingRule(
            "sigmoid_group_topk",
            top_k=self.top_k,
            normalize=bool(cfg.get("norm_topk_prob", True)),
            scaling=float(cfg.get("routed_scaling_factor") or 1.0),
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
        )

    def runtime_local_name(self, local_key: str) -> str:
        return local_key.replace("self_attn.attention_sink_bias", "self_attn.sinks", 1)


class BeamAdapter(_GroupedQueryAttentionAdapter):
    """Beam (``beam``): DeepSeek-V3's router without shared experts, whose weights the MoE block (not the router)
    multiplies by ``routed_scaling_factor`` after the experts: the rule's weights are the router's, unscaled, and that
    factor is outside the routed experts' view. Without ``mlp_layer_types`` the first three layers are dense."""

    family = "beam"
    model_types = ("beam",)
    num_experts_keys = ("num_experts", "n_routed_experts")
    first_dense_default = 3

    def is_moe_layer(self, layer: int) -> bool:
        return self.listed_moe_layer(layer, layer >= self.first_dense_default)

    def routing_rule(self) -> RoutingRule:
        return replace(super().routing_rule(), scaling=1.0)


class AXK1Adapter(DeepseekV3Adapter):
    """A.X-K1 (``axk1``): DeepSeek-V3 (MLA) whose MoE block RMS-normalises its output (routed plus shared experts);
    the release stores that norm at the decoder layer (``post_mlp_layernorm``), transformers moves it into the block
    (``mlp.post_mlp_layernorm``) at load. The norm is outside the routed experts' view, as the shared experts are."""

    family = "axk1"
    model_types = ("axk1",)
    first_dense_default = 1

    def runtime_local_name(self, local_key: str) -> str:
        if local_key.startswith("post_mlp_layernorm."):
            return "mlp." + local_key
        return local_key


class SolarOpenAdapter(_GroupedQueryAttentionAdapter):
    """Solar Open: every decoder layer is MoE (transformers ignores ``first_k_dense_replace``)."""

    family = "solar_open"
    model_types = ("solar_open",)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0


class ExaoneMoeAdapter(CorrectionBiasOffRouter, _GroupedQueryAttentionAdapter):
    """EXAONE MoE: the correction bias is stored on the MoE block (``mlp.e_score_correction_bias``); transformers
    moves it under the router at load."""

    family = "exaone_moe"
    model_types = ("exaone_moe",)
    correction_bias_key = "mlp.e_score_correction_bias"
    num_experts_keys = ("num_experts", "n_routed_experts")
    first_dense_default = 1


class Glm4vMoeAdapter(TextTowerBesideVision, Glm4MoeAdapter):
    """GLM-4.5V/4.6V: GLM-4.5's text tower under ``model.language_model`` beside the vision tower ``model.visual``
    (passed through untouched); calibrated on text."""

    family = "glm4v_moe"
    model_types = ("glm4v_moe",)
