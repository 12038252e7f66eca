"""MiniMax-M3 (``minimax_m3_vl``, its text model ``minimax_m3_vl_text``): a decoder whose MoE layers
(``mlp_layer_types`` ``sparse``; the release's ``moe_layer_freq``) route by sigmoid scores plus
``e_score_correction_bias``, top-k without groups, renormalised; the block multiplies the routed experts' sum by
``routed_scaling_factor`` after them (outside the routed experts' view, as Beam's). Experts and the shared expert
compute GPT-OSS's clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)`` (``swiglu_alpha``/``swiglu_limit`` of the
config, one per model) on non-interleaved gate and up halves. Layers whose ``layer_types`` entry is
``minimax_m3_sparse`` attend sparsely through a lightning indexer of their own.

- ``minimax_m3_vl_text``: transformers' names, what ``save_pretrained`` of ``MiniMaxM3VLForCausalLM`` writes
  (``mlp.gate.{weight,e_score_correction_bias}``, fused ``mlp.experts.{gate_up,down}_proj``, ``mlp.shared_experts``).
- ``minimax_m3_vl`` (the release, what ``save_pretrained`` of ``MiniMaxM3SparseForConditionalGeneration`` writes):
  the text model under ``language_model.model.*`` beside ``vision_tower.*``, ``multi_modal_projector.*`` and
  ``patch_merge_mlp.*``, with MiniMax's names: ``block_sparse_moe.{gate.weight,e_score_correction_bias}``, per-expert
  ``block_sparse_moe.experts.{e}.w1/w3/w2``, ``block_sparse_moe.shared_experts`` and dense ``mlp`` with separate
  ``gate_proj``/``up_proj`` (fused to ``gate_up_proj`` at load), ``self_attn.index_{q,k}_{proj,norm}`` (the
  indexer's, ``self_attn.indexer.*`` at load).
"""

from __future__ import annotations

import re

import torch

from .base import FamilyAdapter
from .block_bias import CorrectionBiasOffRouter
from .gpt_oss import GptOssAdapter
from .llava_layout import LlavaLayout
from .routing import RoutingRule

_SPLIT_GATE_UP = re.compile(r"^(mlp\.(?:shared_experts\.)?)gate_proj\.weight$")
_INDEXER = re.compile(r"^self_attn\.index_(q|k)_(proj|norm)\.")


class MiniMaxM3TextAdapter(FamilyAdapter):
    family = "minimax_m3_vl_text"
    model_types = ("minimax_m3_vl_text",)
    num_experts_keys = ("num_local_experts", "num_experts")
    has_correction_bias = True
    activation = GptOssAdapter.activation

    def is_moe_layer(self, layer: int) -> bool:
        kinds = self.text_config.get("mlp_layer_types")
        if not kinds and self.text_config.get("moe_layer_freq") is not None:
            kinds = ["sparse" if flag else "dense" for flag in self.text_config["moe_layer_freq"]]
        return self.num_experts > 0 and (kinds[layer] == "sparse" if kinds else True)

    def softmax_attention(self, layer: int) -> bool:
        """Full-attention layers attend with softmax over every token; ``minimax_m3_sparse`` layers over the blocks
        their indexer picks (the release lists them in ``sparse_attention_config.sparse_attention_freq``)."""
        kinds = self.text_config.get("layer_types")
        if not kinds:
            flags = (self.text_config.get("sparse_attention_config") or {}).get("sparse_attention_freq")
            kinds = ["minimax_m3_sparse" if flag else "full_attention" for flag in flags] if flags else None
        return not kinds or kinds[layer] == "full_attention"

    def routing_rule(self) -> RoutingRule:
        return RoutingRule("sigmoid_group_topk", top_k=self.top_k, normalize=True)


class MiniMaxM3VLAdapter(LlavaLayout, CorrectionBiasOffRouter, MiniMaxM3TextAdapter):
    family = "minimax_m3_vl"
    model_types = ("minimax_m3_vl",)
    vision_prefixes = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.")
    moe_disk_prefix = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")
    correction_bias_key = "block_sparse_moe.e_score_correction_bias"

    def runtime_local_name(self, local_key: str) -> str:
        local_key = local_key.replace("block_sparse_moe.", "mlp.", 1)
        return _INDEXER.sub(r"self_attn.indexer.\1_\2.", local_key)

    def runtime_local_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The shared expert's and the dense MLP's ``gate_proj`` and ``up_proj`` as the one ``gate_up_proj``."""
        for key in [key for key in state if _SPLIT_GATE_UP.match(key)]:
            prefix = _SPLIT_GATE_UP.match(key).group(1)
            gate, up = state.pop(key), state.pop(f"{prefix}up_proj.weight")
            state[f"{prefix}gate_up_proj.weight"] = torch.cat([gate, up], dim=0)
        return state
