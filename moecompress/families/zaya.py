"""ZAYA1 (``zaya``): a router that carries its state from layer to layer, and a skip expert.

The router of layer ``i`` (``mlp.gate``) projects the token down (``down_proj``, to ``router_hidden_size``), adds the
previous layer's projected state times ``router_states_scale`` (every layer but the first), runs a small MLP on it
(``router_mlp.{norm,fc1,fc2}``) and scores ``num_experts + 1`` classes with ``router_mlp.out_proj``: the experts, then
one skip expert that computes nothing. Softmax over all of them, the top-k (k = 1) of the probabilities plus
``balancing_biases`` (the skip expert's is always -1: stock transformers sets it at load), weighted by the uncorrected
probability, not renormalised; a token sent to the skip expert gets no MoE output. Each decoder layer returns
``(hidden, router state)`` and the next takes that state as its second argument; the layer sweep carries it
(:mod:`moecompress.sweep.layer_carry`).

The view's router weight is ``out_proj.weight`` ``[E + 1, R]`` and the router's input the MLP's output before it
(:attr:`router_input_module`, captured by the sweep: the stock modules compute the projection, the carried state and
the MLP, which stay layer tensors, never pruned or quantised). The skip expert is a router column past the experts, as
LongCat-Flash's identity experts are (:attr:`MoEWeights.identity_experts`), with a zero output; ``balancing_biases``
is the view's correction bias, over all ``E + 1`` columns. Pruning keeps the skip expert's row; stock transformers
builds ``num_experts + 1`` classes from the rewritten ``num_experts``.

transformers has no conversion rule for ZAYA, so the release holds the modules' names (what ``save_pretrained`` of
``ZayaForCausalLM`` writes): fused ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from .base import FamilyAdapter, MoEWeights
from .routing import RoutingRule


class ZayaAdapter(FamilyAdapter):
    family = "zaya"
    model_types = ("zaya",)
    has_correction_bias = True
    layer_returns_tuple = True
    carried_outputs: ClassVar[dict[int, str | int]] = {1: 0}
    """The router state (the layer's second output) is the next layer's first argument after the hidden states."""

    def identity_experts(self, layer: int) -> int:
        return 1

    def routing_rule(self) -> RoutingRule:
        return RoutingRule("softmax_bias_topk", top_k=self.top_k, normalize=False)

    def _router_key(self, layer: int, name: str) -> str:
        local = {"weight": "router_mlp.out_proj.weight", "e_score_correction_bias": "balancing_biases"}.get(name, name)
        return f"{self.layer_prefix(layer)}mlp.gate.{local}"

    def _check_shapes(self, layer: int, moe: MoEWeights) -> None:
        """The router weight multiplies the router MLP's ``router_hidden_size`` output, not the hidden states."""
        from ..errors import UserInputError

        want = (moe.router_columns, int(self.text_config.get("router_hidden_size", 256)))
        if tuple(moe.router_weight.shape) != want:
            raise UserInputError(
                f"layer {layer} ({self._router_key(layer, 'weight')}): shape {list(moe.router_weight.shape)}, "
                f"config.json implies {list(want)}"
            )
        hidden = int(self.text_config["hidden_size"])
        super()._check_shapes(
            layer, replace(moe, router_weight=moe.router_weight.new_empty(moe.router_columns, hidden))
        )

    @property
    def router_input_module(self) -> str:
        return "mlp.gate.router_mlp.out_proj"

    def runtime_router_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        """The skip expert's balancing bias at -1, as stock transformers loads it."""
        return {
            "mlp.gate.router_mlp.out_proj.weight": moe.router_weight,
            "mlp.gate.balancing_biases": self._stock_biases(moe).correction_bias,
        }

    @staticmethod
    def _stock_biases(moe: MoEWeights) -> MoEWeights:
        if moe.correction_bias is None:
            return moe
        bias = moe.correction_bias.clone()
        bias[moe.num_experts :] = -1.0
        return replace(moe, correction_bias=bias)

    # ---- computation --------------------------------------------------------------------------------------
    def router_logits(self, moe: MoEWeights, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.reshape(-1, hidden.shape[-1]).float(), moe.router_weight.float())

    def route(
        self,
        moe: MoEWeights,
        logits: torch.Tensor,
        allowed: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule's choice with the skip expert's balancing bias at -1, which stock transformers sets at load
        whatever the checkpoint holds; a skip choice weighs 0, as the stock router gives it."""
        moe = self._stock_biases(moe)
        ids, weights = super().route(moe, logits, allowed, token_ids)
        return ids, weights.masked_fill(ids >= moe.num_experts, 0.0)

    def expert_output(self, moe: MoEWeights, expert: int, hidden: torch.Tensor) -> torch.Tensor:
        if expert >= moe.num_experts:
            return torch.zeros_like(hidden)
        return super().expert_output(moe, expert, hidden)

    # ---- the stock router ---------------------------------------------------------------------------------
    def route_of(self, output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stock router returns ``(logits, weights, ids, state)`` with a skip choice as expert 0 at weight 0; the
        view's ids name the skip expert (column ``E``)."""
        logits, weights, ids = output[0], output[1], output[2]
        return logits, weights, ids.masked_fill(weights == 0, logits.shape[-1] - 1)

    def with_route(self, output: Any, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        skip = ids == output[0].shape[-1] - 1
        weights = weights.to(output[1].dtype).masked_fill(skip, 0)
        return output[0], weights, ids.masked_fill(skip, 0), output[3]

    def stock_route(self, model: torch.nn.Module, layer: int, hidden: torch.Tensor):
        return self.route_of(self.router_of(model, layer)(hidden[None]))
