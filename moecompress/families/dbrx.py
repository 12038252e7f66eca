"""DBRX (``dbrx``; databricks/dbrx-instruct).

A decoder block (``transformer.blocks.{i}``) is ``norm_attn_norm`` (both norms around the attention) and ``ffn``. The
FFN's router (``ffn.router.layer``) returns logits only; the FFN picks the experts itself: softmax, top-k, the k
weights divided by their ``ffn_config.moe_normalize_expert_weights``-norm (p = 1 in the release; not renormalised
where it is null), then calls its experts module with the choice. That module keeps each matrix of every expert in
one ``[E * I, H]`` parameter of an inner ``mlp``: ``w1`` (gate), ``v1`` (up) and ``w2`` (down, transposed); the release
stores them so (transformers converts nothing). Sizes live in ``d_model``/``n_layers``/``n_heads`` and the
``attn_config``/``ffn_config`` sections, which :attr:`DbrxAdapter.text_config` presents under the usual keys.

The route is read from the router's logits as the FFN computes it; a reroute replaces the choice where the experts
module receives it (a forward pre-hook), so a rerouted layer computes exactly what a model with the removed experts'
router rows deleted computes.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import OptionError, UserInputError
from ..vocabulary import named
from .base import FamilyAdapter, Layout, MoEWeights, ParamClass
from .routing import RoutingRule

_EXPERT_PARAMS = ("w1", "v1", "w2")


class DbrxAdapter(FamilyAdapter):
    family = "dbrx"
    model_types = ("dbrx",)
    layers_prefix = "transformer.blocks."
    moe_disk_prefix = "ffn."
    router_module = "ffn.router"
    router_key = "router.layer"
    attention_module = "norm_attn_norm.attn"
    num_experts_keys = ("moe_num_experts",)
    shared_expert_markers = ()

    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        act = (self._ffn.get("ffn_act_fn") or {}).get("name", "silu")
        if act not in ("silu", "swish"):
            raise UserInputError(f"dbrx: ffn_config.ffn_act_fn {act!r}: moecompress supports DBRX's silu experts only")

    @property
    def _ffn(self) -> dict[str, Any]:
        return self.config.get("ffn_config") or {}

    @property
    def text_config(self) -> dict[str, Any]:
        """The config with DBRX's sizes also under the keys the rest of moecompress reads."""
        config, ffn = self.config, self._ffn
        attn = config.get("attn_config") or {}
        heads = config.get("n_heads")
        return {
            **config,
            "num_hidden_layers": config.get("n_layers"),
            "hidden_size": config.get("d_model"),
            "num_attention_heads": heads,
            "num_key_value_heads": attn.get("kv_n_heads") or config.get("num_key_value_heads") or heads,
            "moe_num_experts": ffn.get("moe_num_experts"),
            "num_experts_per_tok": ffn.get("moe_top_k", 1),
            "moe_intermediate_size": ffn.get("ffn_hidden_size"),
            "hidden_act": (ffn.get("ffn_act_fn") or {}).get("name", "silu"),
            "max_position_embeddings": config.get("max_seq_len"),
        }

    def with_expert_counts(self, counts: dict[int, int], kept: dict[int, list[int]]) -> dict[str, Any]:
        config = super().with_expert_counts(counts, kept)
        if "moe_num_experts" in config:
            config["ffn_config"]["moe_num_experts"] = config.pop("moe_num_experts")
        return config

    def check_expert_pruning(self, source: str = "model", config: Any = None) -> None:
        """Global scope is refused: the plugin rebuilds a block with its own expert count from a top-level count
        attribute, and DBRX keeps its count in ``ffn_config``, so a layer with another count would not load."""
        if getattr(config, "scope", None) == "global":
            raise OptionError(
                f"{source}: dbrx keeps its expert count in ffn_config, which moecompress's loader cannot set per "
                f"layer; prune with {named('scope', 'layer')}",
                type(config),
            )

    @property
    def _norm_p(self) -> float | None:
        p = self._ffn.get("moe_normalize_expert_weights", 1.0)
        return None if p is None else float(p)

    def routing_rule(self) -> RoutingRule:
        p = self._norm_p
        return RoutingRule("softmax_topk", top_k=self.top_k, normalize=p is not None, norm_p=p)

    # ---- keys ---------------------------------------------------------------------------------------------
    def classify_key(self, key: str) -> ParamClass:
        if key.startswith("transformer.wte."):
            return "embeddings"
        layer = self.layer_of_key(key)
        if layer is not None and key[len(self.layer_prefix(layer)) :].startswith("norm_attn_norm.norm_"):
            return "norms"
        return super().classify_key(key)

    # ---- layer tensors <-> MoE view -------------------------------------------------------------------------
    def detect_layout(self, layer: int, keys: set[str] | dict) -> Layout:
        if self._fused_key(layer, "mlp.w1") in keys:
            return "fused"
        raise KeyError(f"layer {layer}: no expert tensors found under {self._fused_key(layer, 'mlp.')}")

    def _pop_experts(self, layer: int, rest: dict[str, torch.Tensor], layout: Layout) -> MoEWeights:
        experts, inter = self.experts_in_layer(layer), int(self._ffn.get("ffn_hidden_size") or 0)
        hidden = int(self.text_config["hidden_size"])
        parts = []
        for name in _EXPERT_PARAMS:
            key = self._fused_key(layer, f"mlp.{name}")
            tensor = rest.pop(key)
            if tuple(tensor.shape) != (experts * inter, hidden):
                raise UserInputError(
                    f"{key}: shape {list(tensor.shape)}, config.json implies {[experts * inter, hidden]} "
                    f"({experts} experts of ffn_hidden_size {inter})"
                )
            parts.append(tensor.reshape(experts, inter, hidden))
        gate, up, down = parts
        return MoEWeights(
            router_weight=torch.empty(0, device="cpu"),
            gate_up=torch.cat([gate, up], dim=1),
            down=down.transpose(1, 2).contiguous(),
        )

    def _expert_tensors(self, layer: int, moe: MoEWeights, layout: Layout | None) -> dict[str, torch.Tensor]:
        inter, hidden = moe.intermediate_size, moe.gate_up.shape[-1]
        flat = (moe.num_experts * inter, hidden)
        matrices = (moe.gate_up[:, :inter], moe.gate_up[:, inter:], moe.down.transpose(1, 2))
        return {
            self._fused_key(layer, f"mlp.{name}"): matrix.reshape(flat).contiguous()
            for name, matrix in zip(_EXPERT_PARAMS, matrices, strict=True)
        }

    # ---- the loaded transformers model ----------------------------------------------------------------------
    def runtime_moe_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        prefix_len = len(self.layer_prefix(0))
        state = {key[prefix_len:]: value for key, value in self._expert_tensors(0, moe, "fused").items()}
        state.update(self.runtime_router_state(moe))
        return state

    def runtime_router_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        return {f"{self.router_module}.layer.weight": moe.router_weight}

    def stock_experts_weights(self, module: torch.nn.Module) -> tuple[Any, Any, bool]:
        """``DbrxExperts`` holds ``mlp.w1``/``v1``/``w2`` ``[E * I, H]``: meta tensors of the canonical shapes."""
        experts, inter, hidden = module.num_experts, module.ffn_hidden_size, module.hidden_size
        dtype = module.mlp.w1.dtype
        return (
            torch.empty(experts, 2 * inter, hidden, dtype=dtype, device="meta"),
            torch.empty(experts, hidden, inter, dtype=dtype, device="meta"),
            True,
        )

    def route_of(self, output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's logits, and the choice ``DbrxFFN.route_tokens_to_experts`` makes from them."""
        logits = output
        probs = torch.softmax(logits, dim=1, dtype=logits.dtype)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self._norm_p is not None:
            weights = weights / torch.norm(weights, p=self._norm_p, dim=-1, keepdim=True)
        return logits, weights, ids

    def with_route(self, output: Any, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        """Logits from which the FFN picks ``ids`` with ``weights``: their logarithms at ``ids``, -inf elsewhere. The
        softmax and p-norm then give back ``weights`` (to rounding) when their p-norm is 1, as the family's rule
        makes it; the weights of a release that does not renormalise (p null) cannot be expressed so."""
        self.check_route_replay()
        return torch.full_like(output, float("-inf")).scatter(1, ids, weights.to(output.dtype).log())

    def check_route_replay(self, source: str = "model") -> None:
        if self._norm_p is None:
            raise UserInputError(
                f"{source}: dbrx with ffn_config.moe_normalize_expert_weights null: a replayed route's weights cannot "
                "be passed through DBRX's router logits, so QAT's route replay cannot run"
            )

    def reroute_hooks(self, layer_module: torch.nn.Module, choose) -> list[Any]:
        logits: list[torch.Tensor] = []

        def keep_logits(router, inputs, output):
            logits[:] = [output]

        def reroute(experts, args):
            hidden = args[0]
            ids, weights = choose(logits.pop())
            return hidden, ids, weights.to(hidden.dtype)

        return [
            layer_module.get_submodule(self.router_module).register_forward_hook(keep_logits),
            layer_module.get_submodule(self.experts_module).register_forward_pre_hook(reroute),
        ]

    def stock_experts(
        self, model: torch.nn.Module, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """``DbrxExperts`` returns ``[T, 1, H]`` for tokens ``[T, H]``."""
        return self.experts_of(model, layer)(hidden, ids, weights).reshape(hidden.shape)
