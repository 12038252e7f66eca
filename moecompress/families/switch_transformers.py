"""Switch Transformers (``switch_transformers``; google/switch-base-8): the expert view of an encoder-decoder MoE.

Not registered in :data:`~moecompress.families.ADAPTERS`: the family stays refused until merging, the router refit
and the imatrix apply the capacity per sequence and the plugin handles its experts (see docs/families.md, "Known
gaps"). What is here is the view, what the layer sweep needs to run both stacks and the per-sequence routing of
frequency, REAP, ΔH, GPTQ and the low-rank compensation, tested against the stock modules; the calibration
(span corruption) and evaluation (the decoder's targets) are in :mod:`moecompress.calibration.span_corruption` and
:mod:`moecompress.evals.perplexity`.

Layers are numbered over both stacks: the encoder's blocks ``0 .. num_layers - 1`` (``encoder.block.{i}.``), then
the decoder's (``decoder.block.{i}.`` as layer ``num_layers + i``). A block's feed-forward is its last sub-layer:
``layer.1`` in the encoder (after self-attention), ``layer.2`` in the decoder (after cross-attention). It is sparse
where transformers' ``SwitchTransformersStack`` makes it so: ``i % step == 1`` (every block when ``step == 1``),
with ``step = layers // num_sparse_*_layers`` as the config class computes it. Its experts are
``mlp.experts.expert_{j}.wi`` / ``.wo`` (not gated: ``wo(act(wi x))``, ``dense_act_fn``), its router
``mlp.router.classifier``: softmax over the experts in float32, the best one, weighted by its probability
(not renormalised). Each expert takes at most ``expert_capacity`` tokens of a sequence, in token order; the tokens
past it get no expert (the block adds nothing to their residual stream), which :meth:`capacity_kept` reproduces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from .base import FamilyAdapter, Layout, MoEWeights, ParamClass
from .routing import RoutingRule


def capacity_kept(ids: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Whether each token of one sequence keeps its expert ``ids`` ``[S, 1]`` under the per-expert ``capacity``
    (``SwitchTransformersTop1Router``: the first ``capacity`` tokens sent to an expert, in order): ``[S, 1]``."""
    one_hot = nn.functional.one_hot(ids[:, 0], num_classes=num_experts)
    priority = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1, keepdim=True)
    return priority <= capacity


class SwitchTransformersAdapter(FamilyAdapter):
    family = "switch_transformers"
    model_types = ("switch_transformers",)
    auto_class = "AutoModelForSeq2SeqLM"
    gated_experts = False
    expert_names = ("wi", "wi", "wo")
    router_key = "router.classifier"
    router_module = "mlp.router"
    num_experts_keys = ("num_experts",)
    layer_returns_tuple = True
    layer_output_extras = 2
    carried_outputs: ClassVar[dict[int, str | int]] = {1: 1, 2: 4}
    """A block's position biases (self-attention, cross-attention), computed by each stack's first block and
    handed on to the next block as its arguments ``position_bias`` and ``encoder_decoder_position_bias``."""
    attention_module = "layer.0.SelfAttention"
    attention_weights_output = 2
    per_sequence_routing = True
    experts_one_hot_dispatch = True
    layer_stacks = ("encoder.block", "decoder.block")
    encoder_output_norm = "encoder.final_layer_norm"
    encoder_output_argument = 2

    # ---- config -----------------------------------------------------------------------------------------
    @property
    def text_config(self) -> dict[str, Any]:
        """The config with the names the view reads for T5's (``d_model``, ``num_heads``), the layers of both
        stacks counted together."""
        config = self.config
        return {
            **config,
            "hidden_size": config["d_model"],
            "num_attention_heads": config["num_heads"],
            "num_hidden_layers": self.num_layers,
            "num_experts_per_tok": 1,
        }

    @property
    def encoder_layers(self) -> int:
        return int(self.config["num_layers"])

    @property
    def num_layers(self) -> int:
        return self.encoder_layers + int(self.config.get("num_decoder_layers") or self.encoder_layers)

    @property
    def top_k(self) -> int:
        return 1

    def stack_of(self, layer: int) -> tuple[str, int]:
        """``("encoder" | "decoder", the block's index in its stack)`` of layer ``layer``."""
        if layer < self.encoder_layers:
            return "encoder", layer
        return "decoder", layer - self.encoder_layers

    def stack_starts(self) -> tuple[int, ...]:
        return (0, self.encoder_layers)

    def is_moe_layer(self, layer: int) -> bool:
        stack, index = self.stack_of(layer)
        blocks = self.num_layers - self.encoder_layers if stack == "decoder" else self.encoder_layers
        sparse = int(self.config.get(f"num_sparse_{stack}_layers") or 0)
        if self.num_experts <= 0 or sparse <= 0:
            return False
        step = blocks // sparse
        return step == 1 or index % step == 1

    def routing_rule(self) -> RoutingRule:
        return RoutingRule("softmax_topk", top_k=1, normalize=False)

    def activation(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        from transformers.activations import ACT2FN

        return ACT2FN[self.config.get("dense_act_fn", "relu")](up)

    @property
    def capacity(self) -> int:
        return int(self.config["expert_capacity"])

    # ---- keys -------------------------------------------------------------------------------------------
    def layer_prefix(self, layer: int) -> str:
        stack, index = self.stack_of(layer)
        return f"{stack}.block.{index}."

    def layer_of_key(self, key: str) -> int | None:
        stack, _, rest = key.partition(".block.")
        head = rest.split(".", 1)[0]
        if stack not in ("encoder", "decoder") or not head.isdigit():
            return None
        return int(head) + (self.encoder_layers if stack == "decoder" else 0)

    def feed_forward(self, layer: int) -> str:
        """The block's feed-forward sub-layer, under :meth:`layer_prefix`: ``layer.1`` or ``layer.2``."""
        return "layer.2" if self.stack_of(layer)[0] == "decoder" else "layer.1"

    def runtime_in_layer(self, layer: int, name: str) -> str:
        return f"{self.feed_forward(layer)}.{name}" if name else self.feed_forward(layer)

    def moe_prefix(self, layer: int) -> str:
        return f"{self.layer_prefix(layer)}{self.feed_forward(layer)}.mlp."

    def _expert_key(self, layer: int, expert: int, which: int) -> str:
        return f"{self.moe_prefix(layer)}experts.expert_{expert}.{self.expert_names[which]}.weight"

    def _router_key(self, layer: int, name: str) -> str:
        return f"{self.moe_prefix(layer)}{self.router_key}.{name}"

    def classify_key(self, key: str) -> ParamClass:
        layer = self.layer_of_key(key)
        if layer is None:
            return "embeddings" if key.split(".")[-2] in ("shared", "embed_tokens", "lm_head") else "norms"
        local = key[len(self.moe_prefix(layer)) :] if key.startswith(self.moe_prefix(layer)) else None
        if local is not None and local.startswith("router."):
            return "router"
        if local is not None and local.startswith("experts."):
            return "experts"
        if "SelfAttention." in key or "EncDecAttention." in key:
            return "attention"
        return "norms" if "layer_norm" in key else "other"

    def detect_layout(self, layer: int, keys: set[str] | dict) -> Layout:
        if self._expert_key(layer, 0, 1) in keys:
            return "per_expert"
        raise KeyError(f"layer {layer}: no expert tensors found under {self.moe_prefix(layer)}experts")

    def split_layer(
        self, layer: int, tensors: dict[str, torch.Tensor], *, consume: bool = False
    ) -> tuple[MoEWeights | None, dict[str, torch.Tensor], Layout | None]:
        from ..checkpoint.reader import materialise

        rest = {key: materialise(value) for key, value in tensors.items()}
        if consume:
            tensors.clear()
        if not self.is_moe_layer(layer):
            return None, rest, None
        layout = self.detect_layout(layer, rest)
        count = self.experts_in_layer(layer)
        ups = [rest.pop(self._expert_key(layer, expert, 1)) for expert in range(count)]
        downs = [rest.pop(self._expert_key(layer, expert, 2)) for expert in range(count)]
        moe = MoEWeights(
            router_weight=rest.pop(self._router_key(layer, "weight")),
            gate_up=torch.stack(ups),
            down=torch.stack(downs),
            router_bias=rest.pop(self._router_key(layer, "bias"), None),
            expert_ids=self.original_expert_ids(layer),
            layer=layer,
        )
        self._check_shapes(layer, moe)
        return moe, rest, layout

    def _expert_tensors(self, layer: int, moe: MoEWeights, layout: Layout | None) -> dict[str, torch.Tensor]:
        out = {}
        for expert in range(moe.num_experts):
            out[self._expert_key(layer, expert, 1)] = moe.gate_up[expert].contiguous()
            out[self._expert_key(layer, expert, 2)] = moe.down[expert].contiguous()
        return out

    # ---- the loaded transformers model --------------------------------------------------------------------
    def runtime_moe_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        local = len(self.layer_prefix(moe.layer))
        return {key[local:]: value for key, value in self._expert_tensors(moe.layer, moe, None).items()} | (
            self.runtime_router_state(moe)
        )

    def runtime_router_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        router = self.runtime_in_layer(moe.layer, f"{self.router_module}.classifier")
        state = {f"{router}.weight": moe.router_weight}
        if moe.router_bias is not None:
            state[f"{router}.bias"] = moe.router_bias
        return state

    def decoder_layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        """Every block of ``model``, numbered as the view numbers layers (encoder first)."""
        return nn.ModuleList([*model.get_submodule("encoder.block"), *model.get_submodule("decoder.block")])

    def _mlp(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        return self.decoder_layers(model)[layer].get_submodule(f"{self.feed_forward(layer)}.mlp")

    def router_of(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        return self._mlp(model, layer).router

    def experts_of(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        return self._mlp(model, layer).experts

    def moe_block_of(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        return self._mlp(model, layer)

    def stock_experts(
        self, model: torch.nn.Module, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The stock experts module called as the block calls it, with the one-hot dispatch of ``ids`` ``[T, 1]``."""
        dispatch = nn.functional.one_hot(ids, num_classes=self.experts_in_layer(layer))
        return self.experts_of(model, layer)(hidden, dispatch, weights)

    def stock_experts_weights(self, module: torch.nn.Module) -> tuple[Any, Any, bool]:
        """The experts' ``wi`` ``[E, I, H]`` and ``wo`` ``[E, H, I]`` as meta tensors (the plugin reads only their
        shapes and dtype): the stock module holds one ``DenseActDense`` per expert."""
        first = module["expert_0"]
        experts, wi, wo = len(module), first.wi.weight, first.wo.weight
        meta = dict(device="meta", dtype=wi.dtype)
        return torch.empty(experts, *wi.shape, **meta), torch.empty(experts, *wo.shape, **meta), False

    def route_of(self, output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits [T, E], weights [T, 1], ids [T, 1])`` of the stock router's ``(dispatch, probability, logits)``:
        the ids are each token's choice before the capacity drops any."""
        _, probs, logits = output
        flat = logits.reshape(-1, logits.shape[-1])
        return flat, probs.reshape(-1, 1), flat.argmax(dim=-1, keepdim=True)

    def with_route(self, output: Any, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        """The stock router's output for the choice ``ids`` ``[T, 1]`` with ``weights``, the capacity applied per
        sequence as the stock router applies it."""
        dispatch, probs, logits = output
        batch, seq, experts = dispatch.shape
        rows = ids.reshape(batch, seq)
        kept = torch.stack([capacity_kept(row[:, None], experts, self.capacity)[:, 0] for row in rows])
        new_dispatch = nn.functional.one_hot(rows, num_classes=experts) * kept[..., None]
        return new_dispatch.to(dispatch.dtype), weights.reshape(batch, seq, 1).to(probs.dtype), logits

    def reroute_hooks(
        self, layer_module: torch.nn.Module, choose: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    ) -> list[Any]:
        sparse = [m for m in layer_module.modules() if type(m).__name__ == "SwitchTransformersTop1Router"]

        def reroute(router, inputs, output):
            ids, weights = choose(self.route_of(output)[0])
            return self.with_route(output, weights, ids)

        return [router.register_forward_hook(reroute) for router in sparse]

    # ---- computation ----------------------------------------------------------------------------------
    def sequence_routing(
        self, moe: MoEWeights, ids: torch.Tensor, weights: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """``weights`` with the tokens past an expert's capacity in their sequence set to zero."""
        kept = [capacity_kept(part, moe.router_columns, self.capacity) for part in ids.split(lengths)]
        return weights * torch.cat(kept)
