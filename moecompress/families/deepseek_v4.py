"""DeepSeek-V4 (``deepseek_v4``): hash-routed first layers, sqrt-softplus routing, hyper-connections.

Each layer's MoE block is ``hash_moe`` or ``moe`` (``mlp_layer_types``; releases give ``num_hash_layers``, the
first layers). A ``moe`` layer routes as DeepSeek-V3 without groups: scores ``sqrt(softplus(logits))``, choice on
scores plus ``gate.bias`` (the correction bias), weights the uncorrected scores renormalised, times
``routed_scaling_factor``. A ``hash_moe`` layer picks its experts from ``gate.tid2eid[token id]`` (a frozen
token-id table) and weighs them with the router's scores of those experts. Only ``moe`` layers are in the expert
view: a hash layer is carried like a dense layer, its experts, router and table unchanged, and the layer sweep runs
it as stock transformers does (its decoder-layer call carries the input ids), so later layers calibrate on what
the table sends. Experts clamp their SwiGLU at ``swiglu_limit`` (gate from above, up on both sides).

The release (``deepseek-ai/DeepSeek-V4-*``) names tensors without ``model.``: ``embed.weight``, ``head.weight``,
``norm.weight``, ``hc_head_{fn,base,scale}``, and per layer ``attn.*``, ``attn_norm``, ``ffn_norm``,
``hc_{attn,ffn}_{fn,base,scale}``, ``ffn.gate.{weight,bias,tid2eid}``, per-expert ``ffn.experts.{e}.w1/w3/w2``
and ``ffn.shared_experts.w1/w3/w2``; transformers renames them at load (``conversion_mapping.py``), and so does
:meth:`DeepseekV4Adapter.runtime_local_name` for the layer sweep. ``mtp.*`` is skipped by transformers and copied
through unchanged.
"""

from __future__ import annotations

import re

import torch

from .base import FamilyAdapter
from .routing import RoutingRule

_LOCAL_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(source), target)
    for source, target in (
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
_HASH_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


class DeepseekV4Adapter(FamilyAdapter):
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

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and self.mlp_kinds()[layer] == "moe"

    def check_expert_pruning(self, source: str = "model") -> None:
        """Refused where the model has hash layers: stock transformers builds every layer with one expert count, so a
        pruned model would need its hash layers' experts removed too, with their token-id tables rewritten."""
        from ..errors import UserInputError

        hashed = [layer for layer, kind in enumerate(self.mlp_kinds()) if kind == "hash_moe"]
        if hashed:
            raise UserInputError(
                f"{source}: deepseek_v4 experts cannot be pruned: layers {hashed} pick experts from a token-id table "
                "(hash routing), and stock transformers builds every layer with one expert count, so their experts "
                "would have to be removed with the table rewritten, which moecompress does not do"
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

    def activation(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        limit = float(self.text_config.get("swiglu_limit", 10.0))
        return torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)

    # ---- on-disk names ---------------------------------------------------------------------------------
    def _router_key(self, layer: int, name: str) -> str:
        """The correction bias is the release's ``ffn.gate.bias`` (the router has no bias of its own)."""
        name = {"e_score_correction_bias": "bias", "bias": "no_router_bias"}.get(name, name)
        return super()._router_key(layer, name)

    # ---- the loaded transformers model ------------------------------------------------------------------
    runtime_layers_path = "model.layers"

    def runtime_local_name(self, local_key: str) -> str:
        for pattern, target in _LOCAL_RENAMES:
            local_key = pattern.sub(target, local_key)
        return local_key

    def runtime_local_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A hash layer's per-expert ``w1``/``w3``/``w2`` as the stock module's fused ``gate_up_proj``/``down_proj``."""
        parts: dict[int, dict[str, torch.Tensor]] = {}
        for key in [key for key in state if _HASH_EXPERT.match(key)]:
            match = _HASH_EXPERT.match(key)
            parts.setdefault(int(match.group(1)), {})[match.group(2)] = state.pop(key)
        if parts:
            experts = [parts[e] for e in sorted(parts)]
            state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([p["w1"], p["w3"]]) for p in experts])
            state["mlp.experts.down_proj"] = torch.stack([p["w2"] for p in experts])
        return state

    def runtime_outside_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_OUTSIDE_NAMES.get(key, key): value for key, value in state.items()}
