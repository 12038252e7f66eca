"""DeepSeek-V4 (``deepseek_v4``): hash-routed first layers, sqrt-softplus routing, hyper-connections.

Each layer's MoE block is ``hash_moe`` or ``moe`` (``mlp_layer_types``; releases give ``num_hash_layers``, the
first layers). A ``moe`` layer routes as DeepSeek-V3 without groups: scores ``sqrt(softplus(logits))``, choice on
scores plus ``gate.bias`` (the correction bias), weights the uncorrected scores renormalised, times
``routed_scaling_factor``. A ``hash_moe`` layer picks its experts from ``gate.tid2eid[token id]`` (a frozen
token-id table) and weighs them with the router's scores of those experts. Both kinds are in the expert view; a hash
layer's table is :attr:`MoEWeights.token_table`, which routes the block by the calibration tokens' ids and which
pruning and merging rewrite (:mod:`.token_table`). Stock transformers builds every layer with one expert count, so
expert pruning keeps the same count in every layer (``--scope layer``). Experts clamp their SwiGLU at
``swiglu_limit`` (gate from above, up on both sides).

The release (``deepseek-ai/DeepSeek-V4-*``) names tensors without ``model.``: ``embed.weight``, ``head.weight``,
``norm.weight``, ``hc_head_{fn,base,scale}``, and per layer ``attn.*``, ``attn_norm``, ``ffn_norm``,
``hc_{attn,ffn}_{fn,base,scale}``, ``ffn.gate.{weight,bias,tid2eid}``, per-expert ``ffn.experts.{e}.w1/w3/w2``
and ``ffn.shared_experts.w1/w3/w2``; transformers renames them at load (``conversion_mapping.py``), and so does
:meth:`DeepseekV4Adapter.runtime_local_name` for the layer sweep. ``mtp.*`` is skipped by transformers and copied
through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import FamilyAdapter, MoEWeights
from .native_names import apply_renames, compile_renames
from .routing import RoutingRule
from .swiglu_clamp import OneSwigluLimit

_LOCAL_RENAMES = compile_renames(
    (r"^attn\.", "self_attn."),
    (r"^ffn\.", "mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^attn_norm\.", "input_layernorm."),
    (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^hc_(attn|ffn)_(fn|base|scale)$", r"\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"^self_attn\.wq_b\.", "self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)
"""transformers' ``deepseek_v4`` renames (``conversion_mapping.py``), on a layer's local keys."""
_OUTSIDE_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


class DeepseekV4Adapter(OneSwigluLimit, FamilyAdapter):
    family = "deepseek_v4"
    model_types = ("deepseek_v4",)
    layers_prefix = "layers."
    moe_disk_prefix = "ffn."
    expert_names = ("w1", "w3", "w2")
    num_experts_keys = ("n_routed_experts", "num_local_experts")
    shared_expert_markers = ("shared_experts.",)
    has_correction_bias = True

    def mlp_kinds(self) -> list[str]:
        """Each layer's MoE kind, ``hash_moe`` or ``moe``, as transformers' config reads it."""
        cfg = self.text_config
        kinds = cfg.get("mlp_layer_types")
        if kinds:
            return list(kinds)
        hashed = int(cfg.get("num_hash_layers", 3))
        return ["hash_moe" if i < hashed else "moe" for i in range(self.num_layers)]

    def hash_layer(self, layer: int) -> bool:
        return self.mlp_kinds()[layer] == "hash_moe"

    def check_expert_pruning(self, source: str = "model", config: Any = None) -> None:
        """Global scope is refused: stock transformers builds every DeepSeek-V4 layer (hash-routed or not) with one
        expert count, and the plugin cannot rebuild a block with its own (its constructor takes the layer index)."""
        from ..errors import OptionError
        from ..vocabulary import named

        if getattr(config, "scope", None) == "global":
            raise OptionError(
                f"{source}: deepseek_v4 keeps one expert count in every layer (stock transformers builds each MoE "
                f"block, hash-routed or not, from the one n_routed_experts); prune with {named('scope', 'layer')}",
                type(config),
            )

    def head_counts(self) -> tuple[int, int, int]:
        cfg = self.text_config
        return int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or 1), int(cfg["head_dim"])

    def softmax_attention(self, layer: int) -> bool:
        """Every layer attends with softmax over a sliding window, compressed entries appended (DeepSeek-V4's
        attention returns those weights, over the window and the compressed keys, not over tokens)."""
        return False

    def routing_rule(self) -> RoutingRule:
        scaling = float(self.text_config.get("routed_scaling_factor", 1.0))
        return RoutingRule("sigmoid_group_topk", top_k=self.top_k, scaling=scaling, score="sqrtsoftplus")

    # ---- on-disk names ---------------------------------------------------------------------------------
    def _router_key(self, layer: int, name: str) -> str:
        """The correction bias is the release's ``ffn.gate.bias`` (the router has no bias of its own)."""
        name = {"e_score_correction_bias": "bias", "bias": "no_router_bias"}.get(name, name)
        return super()._router_key(layer, name)

    def split_layer(
        self, layer: int, tensors: dict[str, torch.Tensor], *, consume: bool = False
    ) -> tuple[MoEWeights | None, dict[str, torch.Tensor], Any]:
        """As every family's, with a hash layer's ``ffn.gate.tid2eid`` as the view's :attr:`MoEWeights.token_table`."""
        moe, rest, layout = super().split_layer(layer, tensors, consume=consume)
        if moe is not None and self.hash_layer(layer):
            from ..errors import UserInputError

            key = self._router_key(layer, "tid2eid")
            if key not in rest:
                raise UserInputError(f"layer {layer} is hash-routed (mlp_layer_types) but {key} is missing")
            table = moe.token_table = rest.pop(key)
            want = [int(self.text_config["vocab_size"]), self.top_k]
            if list(table.shape) != want:
                raise UserInputError(f"{key}: shape {list(table.shape)}, config.json implies {want}")
            if table.numel() and not 0 <= int(table.min()) <= int(table.max()) < moe.num_experts:
                raise UserInputError(f"{key} names experts outside 0..{moe.num_experts - 1}")
        return moe, rest, layout

    def join_layer(
        self, layer: int, moe: MoEWeights | None, rest: dict[str, torch.Tensor], layout: Any
    ) -> dict[str, torch.Tensor]:
        out = super().join_layer(layer, moe, rest, layout)
        if moe is not None and moe.token_table is not None:
            out[self._router_key(layer, "tid2eid")] = moe.token_table
        return out

    # ---- the loaded transformers model ------------------------------------------------------------------
    runtime_layers_path = "model.layers"

    def runtime_local_name(self, local_key: str) -> str:
        return apply_renames(_LOCAL_RENAMES, local_key)

    def runtime_router_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        state = super().runtime_router_state(moe)
        if moe.token_table is not None:
            state[f"{self.router_module}.tid2eid"] = moe.token_table
        return state

    def stock_route(self, model: torch.nn.Module, layer: int, hidden: torch.Tensor, token_ids=None):
        """As every family's; a hash layer's stock router also takes the tokens' ids ``token_ids`` ``[T]``."""
        router = self.router_of(model, layer)
        if not hasattr(router, "tid2eid"):
            return super().stock_route(model, layer, hidden)
        if token_ids is None:
            raise ValueError(f"layer {layer} is hash-routed: its router needs the tokens' ids")
        return self.route_of(router(hidden, token_ids))

    def reroute_hooks(self, layer_module: torch.nn.Module, choose) -> list[Any]:
        """As every family's; a hash router's ``choose`` also gets the tokens' ids (the router's second input)."""
        router = layer_module.get_submodule(self.router_module)
        if not hasattr(router, "tid2eid"):
            return super().reroute_hooks(layer_module, choose)

        def reroute(module, inputs, output):
            ids, weights = choose(self.route_of(output)[0], token_ids=inputs[1].reshape(-1))
            return self.with_route(output, weights, ids)

        return [router.register_forward_hook(reroute)]

    def runtime_outside_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_OUTSIDE_NAMES.get(key, key): value for key, value in state.items()}
