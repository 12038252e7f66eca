"""JetMoE (``jetmoe``; jetmoe/jetmoe-8b).

The MLP's mixture of experts (``mlp``, ``JetMoeMoE``) has no experts module called with the choice: its router
(``mlp.router.layer``; top-k of the logits, softmax over those k) returns the tokens grouped by expert
(``index_sorted_experts, batch_index, batch_gates, expert_size, logits``) and the block runs ``mlp.input_linear``
``[E, 2I, H]`` (gate rows first) and ``mlp.output_linear`` ``[E, H, I]`` on the groups, then adds ``mlp.bias``
``[H]`` once per token. Those weights are the view's ``gate_up`` and ``down`` as they are; the bias is a layer tensor
outside the view. The attention is a mixture of experts too (MoA, ``self_attention.experts.*``): read, written and
quantised as attention (a dense part of the layer). Both sets take their count from ``num_local_experts``, in every
layer, so a layer that keeps k MLP experts keeps k MoA experts: those its router sends the most gate weight to on the
same calibration (:meth:`JetMoeAdapter.attention_expert_hooks`), their rows sliced from the MoA tensors
(:meth:`JetMoeAdapter.select_attention_experts`); counts that differ by layer are refused
(:meth:`JetMoeAdapter.check_expert_pruning`).

The route is read from and written into the router's grouped output exactly (:meth:`JetMoeAdapter.route_of`,
:meth:`JetMoeAdapter.with_route`). For the plugin, each ``JetMoeMoE`` becomes a :class:`JetMoeRoutedBlock` with the
same router and bias and an ``experts`` module called as ``experts(hidden, ids, weights)``
(:meth:`JetMoeAdapter.with_experts_module`), where the quantised experts go.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import FamilyAdapter, Layout, MoEWeights, ParamClass
from .routing import RoutingRule

ATTENTION_EXPERT_TENSORS = ("input_linear.weight", "output_linear.weight", "router.layer.weight")
"""The MoA's tensors under ``self_attention.experts.`` whose first dimension is the expert (its ``bias`` is the
layer's)."""


def grouped(ids: torch.Tensor, weights: torch.Tensor, num_experts: int):
    """``(index_sorted_experts, batch_index, batch_gates, expert_size)`` of a choice ``ids`` ``[T, k]`` with
    ``weights``, as ``JetMoeTopKGating`` groups its own."""
    flat = ids.flatten()
    index_sorted = flat.sort(0)[1]
    batch_index = index_sorted.div(ids.shape[1], rounding_mode="trunc")
    expert_size = torch.bincount(flat, minlength=num_experts).tolist()
    return index_sorted, batch_index, weights.flatten()[index_sorted], expert_size


class GroupedExperts(nn.Module):
    """JetMoE's stock expert computation (``input_linear``, activation, ``output_linear`` on the grouped tokens) as
    an experts module called with the choice."""

    def __init__(self, input_linear: nn.Module, output_linear: nn.Module, activation):
        super().__init__()
        self.input_linear, self.output_linear, self.activation = input_linear, output_linear, activation
        self.num_experts = input_linear.num_experts

    @property
    def gate_up_proj(self) -> torch.Tensor:
        return self.input_linear.weight

    @property
    def down_proj(self) -> torch.Tensor:
        return self.output_linear.weight

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        _, batch_index, gates, sizes = grouped(ids, weights, self.num_experts)
        gate, up = self.input_linear(hidden[batch_index], sizes).chunk(2, dim=-1)
        out = self.output_linear(self.activation(gate) * up, sizes) * gates[:, None].to(hidden.dtype)
        return torch.zeros_like(hidden).index_add(0, batch_index, out.to(hidden.dtype))


class JetMoeRoutedBlock(nn.Module):
    """A ``JetMoeMoE`` whose experts are a module called with the choice: the same router and bias."""

    def __init__(self, router: nn.Module, bias: nn.Parameter, experts: nn.Module, adapter: JetMoeAdapter):
        super().__init__()
        self.router, self.bias, self.experts = router, bias, experts
        self._adapter = adapter

    def forward(self, layer_input: torch.Tensor) -> torch.Tensor:
        flat = layer_input.reshape(-1, layer_input.shape[-1])
        _, weights, ids = self._adapter.route_of(self.router(flat))
        return self.experts(flat, ids, weights).view(layer_input.shape) + self.bias


class JetMoeAdapter(FamilyAdapter):
    family = "jetmoe"
    model_types = ("jetmoe",)
    router_module = "mlp.router"
    router_key = "router.layer"
    attention_module = "self_attention"
    num_experts_keys = ("num_local_experts",)
    shared_expert_markers = ()

    attention_experts = True
    attention_router = "self_attention.experts.router"

    def check_expert_pruning(self, source: str = "model", config: Any = None) -> None:
        """Transformers builds every layer's MoA and MLP experts from one count, ``num_local_experts``: only the
        same count in every layer has a config that loads, so ``--scope global`` (counts per layer) is refused."""
        from ..errors import OptionError
        from ..vocabulary import named

        if config is not None and getattr(config, "scope", "layer") == "global":
            raise OptionError(
                f"{source}: jetmoe builds every layer's attention (MoA) and MLP experts from one count, "
                f"num_local_experts, so every layer must keep as many experts: {named('scope', 'global')} cannot be "
                f"written (use {named('scope', 'layer')})",
                type(config),
            )

    def original_attention_expert_ids(self, layer: int) -> list[int]:
        """Original ids of ``layer``'s MoA experts, from a pruned checkpoint's ``moecompress`` section."""
        kept = self.moecompress_section().get("kept_attention_experts")
        if kept and str(layer) in kept:
            return [int(i) for i in kept[str(layer)]]
        return list(range(self.num_experts))

    def attention_expert_hooks(self, layer_module: nn.Module, into: dict[str, Any]) -> list[Any]:
        """Adds the gate weight the MoA router gives each attention expert, summed over tokens, to
        ``into["attention_expert_load"]`` (float64 ``[E]``)."""

        def record(router, inputs, output):
            _, weights, ids = self.route_of(output)
            load = into.setdefault("attention_expert_load", torch.zeros(router.num_experts, dtype=torch.float64))
            load.index_add_(0, ids.flatten().cpu(), weights.flatten().double().cpu())

        return [layer_module.get_submodule(self.attention_router).register_forward_hook(record)]

    def attention_reroute_hooks(self, layer_module: nn.Module, allowed: torch.Tensor) -> list[Any]:
        """Forward hooks on a runtime decoder layer whose MoA router chooses among the ``allowed`` (bool ``[E]``)
        attention experts only, as the MoA of those experts alone chooses; their handles."""
        rule = self.routing_rule()

        def reroute(router, inputs, output):
            logits = output[4]
            ids, weights = rule.route(logits, None, allowed.to(logits.device))
            return self.with_route(output, weights, ids)

        return [layer_module.get_submodule(self.attention_router).register_forward_hook(reroute)]

    def select_attention_experts(self, layer: int, tensors: dict[str, torch.Tensor], keep: list[int]) -> dict:
        """``tensors`` (on-disk keys) with layer ``layer``'s MoA experts cut to the positions ``keep``."""
        prefix = f"{self.attention_prefix(layer)}experts."
        selected = dict(tensors)
        for name in ATTENTION_EXPERT_TENSORS:
            tensor = selected.get(prefix + name)
            if tensor is not None:
                selected[prefix + name] = tensor.index_select(0, torch.tensor(keep, device=tensor.device))
        return selected

    def routing_rule(self) -> RoutingRule:
        return RoutingRule("topk_softmax", top_k=self.top_k)

    def activation(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        act = self.text_config.get("activation_function", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{self.family}: unsupported expert activation {act!r}")
        return F.silu(gate) * up

    def head_counts(self) -> tuple[int, int, int]:
        """MoA: each of the top-k attention experts adds ``num_key_value_heads`` query heads of ``kv_channels``."""
        cfg = self.text_config
        kv_heads = int(cfg["num_key_value_heads"])
        return kv_heads * self.top_k, kv_heads, int(cfg["kv_channels"])

    def classify_key(self, key: str) -> ParamClass:
        layer = self.layer_of_key(key)
        if layer is not None:
            local = key[len(self.layer_prefix(layer)) :]
            if local.startswith("self_attention."):
                return "attention"
            if local.startswith(("mlp.input_linear.", "mlp.output_linear.")):
                return "experts"
        return super().classify_key(key)

    # ---- layer tensors <-> MoE view -------------------------------------------------------------------------
    def _weight_key(self, layer: int, name: str) -> str:
        return f"{self.layer_prefix(layer)}mlp.{name}.weight"

    def detect_layout(self, layer: int, keys: set[str] | dict) -> Layout:
        if self._weight_key(layer, "input_linear") in keys:
            return "fused"
        raise KeyError(f"layer {layer}: no expert tensors found at {self._weight_key(layer, 'input_linear')}")

    def _pop_experts(self, layer: int, rest: dict[str, torch.Tensor], layout: Layout) -> MoEWeights:
        return MoEWeights(
            router_weight=torch.empty(0, device="cpu"),
            gate_up=rest.pop(self._weight_key(layer, "input_linear")),
            down=rest.pop(self._weight_key(layer, "output_linear")),
        )

    def _expert_tensors(self, layer: int, moe: MoEWeights, layout: Layout | None) -> dict[str, torch.Tensor]:
        return {
            self._weight_key(layer, "input_linear"): moe.gate_up,
            self._weight_key(layer, "output_linear"): moe.down,
        }

    # ---- the loaded transformers model ----------------------------------------------------------------------
    def runtime_moe_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        state = {"mlp.input_linear.weight": moe.gate_up, "mlp.output_linear.weight": moe.down}
        state.update(self.runtime_router_state(moe))
        return state

    def runtime_router_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        return {f"{self.router_module}.layer.weight": moe.router_weight}

    def route_of(self, output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The choice the router's grouped output encodes, as ``[T, k]`` ids and weights (in the model's dtype)."""
        index_sorted, _, gates, sizes, logits = output
        device = logits.device
        experts = torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))
        ids = torch.empty_like(experts).index_copy_(0, index_sorted, experts)
        weights = torch.empty_like(gates).index_copy_(0, index_sorted, gates)
        return logits, weights.view(logits.shape[0], -1), ids.view(logits.shape[0], -1)

    def with_route(self, output: Any, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        logits = output[4]
        return (*grouped(ids, weights.to(output[2].dtype), logits.shape[1]), logits)

    def experts_of(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        """The block's ``experts`` where the plugin placed one, else the stock block's expert computation."""
        block = self.moe_block_of(model, layer)
        experts = getattr(block, "experts", None)
        return experts or GroupedExperts(block.input_linear, block.output_linear, block.activation)

    def with_experts_module(self, model: torch.nn.Module) -> None:
        from transformers.models.jetmoe.modeling_jetmoe import JetMoeMoE

        for name, module in list(model.named_modules()):
            if isinstance(module, JetMoeMoE):
                experts = GroupedExperts(module.input_linear, module.output_linear, module.activation)
                parent, _, child = name.rpartition(".")
                routed = JetMoeRoutedBlock(module.router, module.bias, experts, self)
                setattr(model.get_submodule(parent) if parent else model, child, routed)
