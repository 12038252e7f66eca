"""Qwen3-Omni's thinker on its own (``qwen3_omni_moe_thinker``, ``Qwen3OmniMoeThinkerForConditionalGeneration``):
Qwen3-MoE's decoder and block (softmax top-k, renormalised if ``norm_topk_prob``; per-expert experts on disk;
``mlp_only_layers``/``decoder_sparse_step``) as its text model, kept under the text model's own names beside
``audio_tower.*`` and ``visual.*``, which are passed through untouched. The full ``qwen3_omni_moe`` release (thinker
plus talker) is :mod:`.qwen3_omni`."""

from __future__ import annotations

from .qwen_moe import Qwen3MoeAdapter
from .text_under_model import TextUnderModel


class Qwen3OmniMoeThinkerAdapter(TextUnderModel, Qwen3MoeAdapter):
    family = "qwen3_omni_moe_thinker"
    model_types = ("qwen3_omni_moe_thinker",)
    head_pruning = False
    vision_prefixes = ("audio_tower.", "visual.")
