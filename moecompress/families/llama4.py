"""Llama 4: the text MoE layers of ``llama4`` (``Llama4ForConditionalGeneration``, text tower under
``language_model.model``, beside ``vision_model`` and ``multi_modal_projector``) and of ``llama4_text``
(``Llama4ForCausalLM``, under ``model``).

The MoE block is ``feed_forward``: router ``feed_forward.router`` (no bias), routed experts fused as
``feed_forward.experts.gate_up_proj`` ``[E, H, 2I]`` (gate columns first) and ``feed_forward.experts.down_proj``
``[E, I, H]`` (the bf16 release's layout, which is also the runtime one), and an always-on
``feed_forward.shared_expert``. vLLM's loader also reads experts stored per expert,
``feed_forward.experts.{e}.{gate,up,down}_proj.weight`` (linear orientation); that layout is read and written back
as found (stock transformers has no loader for it).
Layers ``moe_layers`` (else every ``interleave_moe_layer_step``-th) are MoE, the others a dense ``feed_forward`` MLP.

The router keeps the top-k logits and weighs each by its own sigmoid; the block multiplies each token by that
weight *before* the expert (rule ``topk_sigmoid`` with ``scales_input``). The stock router returns dense
``(scores [T, E], logits)``, the scores zero off the top-k, and the block runs every expert on every (scaled,
mostly zero) token; :meth:`route_of` and :meth:`with_route` translate that output to and from ``(ids, weights)``.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import FamilyAdapter, Layout, MoEWeights
from .routing import RoutingRule
from .transposed_experts import TransposedFusedExperts
from .vision_language import TextTowerBesideVision


class Llama4TextAdapter(TransposedFusedExperts, FamilyAdapter):
    family = "llama4_text"
    model_types = ("llama4_text",)
    moe_disk_prefix = "feed_forward."
    router_module = "feed_forward.router"
    router_key = "router"
    num_experts_keys = ("num_local_experts",)

    def is_moe_layer(self, layer: int) -> bool:
        cfg = self.text_config
        if self.num_experts <= 0:
            return False
        if cfg.get("moe_layers") is not None:
            return layer in cfg["moe_layers"]
        step = int(cfg.get("interleave_moe_layer_step") or 1)
        return layer % step == step - 1

    def routing_rule(self) -> RoutingRule:
        return RoutingRule("topk_sigmoid", top_k=self.top_k, scales_input=True)

    def detect_layout(self, layer: int, keys) -> Layout:
        if self._fused_key(layer, "gate_up_proj") in keys:
            return "fused_transposed"
        return super().detect_layout(layer, keys)

    def runtime_moe_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        """Llama 4's runtime layout is its on-disk layout."""
        prefix_len = len(self.layer_prefix(0))
        fused = self._expert_tensors(0, moe, "fused_transposed")
        state = {key[prefix_len:]: value for key, value in fused.items()}
        state.update(self.runtime_router_state(moe))
        return state

    def route_of(self, output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores, logits = output
        ids = torch.topk(logits, self.top_k, dim=1)[1]
        return logits, scores.gather(1, ids), ids

    def with_route(self, output: Any, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        scores, logits = output
        return torch.zeros_like(scores).scatter(1, ids, weights.to(scores.dtype)), logits

    def stock_experts(
        self, model: torch.nn.Module, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The stock block's routed part: every expert on every token scaled by its (dense) score, summed."""
        experts = self.experts_of(model, layer)
        scores = torch.zeros(hidden.shape[0], experts.num_experts, dtype=hidden.dtype, device=hidden.device)
        scores.scatter_(1, ids, weights.to(hidden.dtype))
        routed_in = hidden.repeat(experts.num_experts, 1) * scores.transpose(0, 1).reshape(-1, 1)
        return experts(routed_in).reshape(experts.num_experts, hidden.shape[0], -1).sum(dim=0)


class Llama4Adapter(TextTowerBesideVision, Llama4TextAdapter):
    family = "llama4"
    model_types = ("llama4",)
    layers_prefix = "language_model.model.layers."

    def is_vision_key(self, key: str) -> bool:
        return key.startswith(("vision_model.", "multi_modal_projector."))
