"""Mistral Small 4 (``mistral4``): DeepSeek-V2's decoder (MLA attention, shared experts, the first
``first_k_dense_replace`` layers dense) with experts fused as transformers holds them (``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``: transformers has no per-expert merge rule for it, so
what loads is what ``save_pretrained`` writes) and a softmax router whose top-k weights are renormalised and scaled
by ``routed_scaling_factor``.

The hub release (Mistral-Small-4-119B-2603, block FP8) is ``mistral3``: this decoder as ``text_config`` under
``language_model.model.*`` beside a Pixtral vision tower (:class:`Mistral3Adapter`). transformers builds the text
model through ``AutoModelForImageTextToText`` (``Mistral4ForCausalLM``; ``AutoModelForCausalLM`` has no entry).
"""

from __future__ import annotations

from typing import Any

from ..errors import UserInputError
from .deepseek import _DeepseekAdapter
from .llava_layout import LlavaLayout
from .routing import RoutingRule


class Mistral4Adapter(_DeepseekAdapter):
    family = "mistral4"
    model_types = ("mistral4",)
    auto_class = "AutoModelForImageTextToText"

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        groups = int(self.text_config.get("n_group") or 1)
        if groups > 1 and self.num_experts > 0:
            raise UserInputError(
                f"mistral4: n_group {groups}: its router ranks expert groups by the sum of their two best scores, "
                "which no routing rule models; only n_group 1 (the release's) is supported"
            )

    def routing_rule(self) -> RoutingRule:
        cfg = self.text_config
        return RoutingRule(
            "softmax_group_topk",
            top_k=self.top_k,
            normalize=bool(cfg.get("norm_topk_prob", True)),
            scaling=float(cfg.get("routed_scaling_factor", 1.0)),
        )


class Mistral3Adapter(LlavaLayout, Mistral4Adapter):
    """Mistral Small 4's release: ``model_type: mistral3`` with a ``mistral4`` text config."""

    family = "mistral3"
    model_types = ("mistral3",)
    vision_prefixes = ("vision_tower.", "multi_modal_projector.")
