"""Qwen2-MoE, Qwen3-MoE and OLMoE: ``mlp.gate`` router, per-expert ``gate/up/down_proj`` on disk.

Qwen2-MoE adds a gated shared expert (left untouched by expert passes) and may interleave dense layers
(``decoder_sparse_step``, ``mlp_only_layers``), as may Qwen3-MoE. Attention: Qwen2-MoE has q/k/v biases,
Qwen3-MoE RMS-normalises each head's q and k (``head_dim`` wide), OLMoE normalises the whole q and k projections.
"""

from __future__ import annotations

from .base import FamilyAdapter


class _QwenStyleAdapter(FamilyAdapter):
    def is_moe_layer(self, layer: int) -> bool:
        cfg = self.text_config
        if self.num_experts <= 0:
            return False
        if layer in (cfg.get("mlp_only_layers") or []):
            return False
        step = int(cfg.get("decoder_sparse_step") or 1)
        return (layer + 1) % step == 0


class Qwen2MoeAdapter(_QwenStyleAdapter):
    family = "qwen2_moe"
    model_types = ("qwen2_moe",)
    head_pruning = True


class Qwen3MoeAdapter(_QwenStyleAdapter):
    family = "qwen3_moe"
    model_types = ("qwen3_moe",)
    head_pruning = True
    qk_norm = "per_head"


class OlmoeAdapter(FamilyAdapter):
    family = "olmoe"
    model_types = ("olmoe",)
    head_pruning = True
    qk_norm = "per_projection"


class FlexOlmoAdapter(OlmoeAdapter):
    """FlexOlmo: OLMoE's block and routing in an OLMo-2-style decoder (norms after attention and MLP)."""

    family = "flex_olmo"
    model_types = ("flex_olmo",)
    head_pruning = False


class MellumAdapter(FamilyAdapter):
    """Mellum (``mellum``): Qwen3-MoE's block and names; which layers are MoE comes from ``mlp_layer_types`` (all of
    them without it), sliding or full attention from ``layer_types``."""

    family = "mellum"
    model_types = ("mellum",)

    def is_moe_layer(self, layer: int) -> bool:
        kinds = self.text_config.get("mlp_layer_types")
        return self.num_experts > 0 and (not kinds or kinds[layer] == "sparse")
