"""Qwen2-MoE, Qwen3-MoE and OLMoE: ``mlp.gate`` router, per-expert ``gate/up/down_proj`` on disk.

Qwen2-MoE adds a gated shared expert (left untouched by expert passes) and may interleave dense layers
(``decoder_sparse_step``, ``mlp_only_layers``), as may Qwen3-MoE. Attention: Qwen2-MoE has q/k/v biases,
Qwen3-MoE RMS-normalises each head's q and k (``head_dim`` wide), OLMoE normalises the whole q and k projections.
"""

from __future__ import annotations

from .base import FamilyAdapter
from .routing import RoutingRule


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
    per_expert_linears = True
    llama_cpp_shared_expert = True
    head_pruning = True


class Qwen3MoeAdapter(_QwenStyleAdapter):
    family = "qwen3_moe"
    model_types = ("qwen3_moe",)
    per_expert_linears = True
    llama_cpp_shared_expert = False
    head_pruning = True
    qk_norm = "per_head"


class OlmoeAdapter(FamilyAdapter):
    family = "olmoe"
    model_types = ("olmoe",)
    per_expert_linears = True
    llama_cpp_shared_expert = False
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
        return self.listed_moe_layer(layer, True)


class FlintAdapter(_QwenStyleAdapter):
    """Flint (``flint``): Qwen-style layer selection (``mlp_only_layers``, ``[0, 1]`` when absent, as transformers
    reads it) with an ungated shared expert; the router takes the top-k of the sigmoid scores, renormalised if
    ``norm_topk_prob`` (rule ``sigmoid_group_topk`` with one group, no bias, nothing added to the sum). Attention sinks
    are stored as ``self_attn.softmax_offset`` (``self_attn.sinks`` at runtime)."""

    family = "flint"
    model_types = ("flint",)

    def is_moe_layer(self, layer: int) -> bool:
        cfg = self.text_config
        if cfg.get("mlp_only_layers") is None:
            cfg = dict(cfg, mlp_only_layers=[0, 1])
        only = cfg["mlp_only_layers"]
        step = int(cfg.get("decoder_sparse_step") or 1)
        return self.num_experts > 0 and layer not in only and (layer + 1) % step == 0

    def routing_rule(self) -> RoutingRule:
        normalize = bool(self.text_config.get("norm_topk_prob", True))
        return RoutingRule("sigmoid_group_topk", top_k=self.top_k, normalize=normalize, norm_eps=0.0)

    def runtime_local_name(self, local_key: str) -> str:
        return local_key.replace("self_attn.softmax_offset", "self_attn.sinks", 1)
