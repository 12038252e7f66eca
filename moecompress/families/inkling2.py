"""Inkling 2 (``inkling2_text``; ``inkling2`` with its vision tower): block attention residuals, experts with a
softcapped SwiGLU.

Every decoder layer takes, beside its input, ``block_states`` ``[B, S, n, H]``: the inputs of the layers at each
earlier block boundary (every ``n_layers_per_attn_res_block``-th layer, layer 0 first), stacked; the attention's
and the MoE block's inputs are attention over that stack plus the running state, and so is the final norm's input
(``final_input``). The sweep carries the stack per calibration batch (:attr:`FamilyAdapter.block_states_argument`,
:class:`~moecompress.sweep.layer_carry.LayerCarry`).

The router ``mlp.gate.weight`` ``[E, H]`` (float32) scores by sigmoid; the choice is the top-k of the scores plus
``mlp.gate.e_score_correction_bias``, the chosen scores renormalised and times ``route_scale``. An expert computes
``down(softcap_g(gate) * sigmoid(gate) * softcap_u(up))`` with ``softcap_c(x) = c * tanh(x / c)``
(``mlp_gate_softcap``, ``mlp_up_softcap``), in float32. Every layer is MoE, with no shared experts. The decoder
layer adds a short convolution after the MoE block (``post_mlp_convolution``), outside the MoE output.

Layout: the release's native names, which ``save_pretrained`` writes too (transformers' ``inkling2_text``
conversion rules, reversed): ``model.llm.layers.{i}``, ``attn.{wq_du,wk_dv,wv_dv,wr_du,wo_ud,gate_attn,...}``,
``attn_norm``/``mlp_norm``, ``attn_sconv``/``mlp_sconv``, fused experts ``mlp.experts.w13_weight`` ``[E, 2I, H]``
with gate and up rows interleaved and ``w2_weight`` ``[E, H, I]``, the correction bias as ``mlp.gate.bias``; the
block-residual queries outside the layers, ``model.llm.attn_res.attn_queries.{i}`` (layer ``i + 1``'s),
``attn_res.mlp_queries.{i}`` and ``attn_res.output_query``, which the view counts as layer ``i + 1``'s, layer
``i``'s and outside tensors; ``model.llm.{embed,embed_norm,norm,unembed}``, the output projection padded to
``vocab_size`` rows (``unpadded_vocab_size`` at runtime). The ``inkling2`` release (Inkling-2-Small) has the
same text names (runtime ``model.language_model.*``) beside its vision tower ``model.visual.*``, passed through.
"""

from __future__ import annotations

import re

import torch

from .base import FamilyAdapter
from .interleaved_experts import InterleavedW13Experts
from .native_names import NativeNames, compile_renames
from .routing import RoutingRule
from .vision_language import LanguageModelAtRuntime

_LOCAL = compile_renames(
    (r"^mlp\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"^attn\.", "self_attn."),
    (r"^self_attn\.wq_du", "self_attn.q_proj.linear"),
    (r"^self_attn\.wk_dv", "self_attn.k_proj.linear"),
    (r"^self_attn\.wv_dv", "self_attn.v_proj.linear"),
    (r"^self_attn\.k_sconv\.", "self_attn.k_proj.sconv."),
    (r"^self_attn\.v_sconv\.", "self_attn.v_proj.sconv."),
    (r"^self_attn\.rel_logits_proj\.", "self_attn.relative_position_bias."),
    (r"^self_attn\.wr_du", "self_attn.relative_position_bias.linear"),
    (r"^self_attn\.q_l2_clip\.", "self_attn.q_proj.norm."),
    (r"^self_attn\.rel_l2_clip\.", "self_attn.relative_position_bias.norm."),
    (r"^self_attn\.wo_ud", "self_attn.o_proj.linear"),
    (r"^self_attn\.gate_attn", "self_attn.o_proj.gate_proj"),
    (r"^self_attn\.attn_sink_proj", "self_attn.sink_proj"),
    (r"^attn_sconv\.", "post_attention_convolution."),
    (r"^mlp_sconv\.", "post_mlp_convolution."),
    (r"(convolution|sconv)\.weight(?!_)", r"\1.conv1d.weight"),
    (r"(convolution|sconv)\.static_w", r"\1.static_weight"),
    (r"(convolution|sconv)\.weight_proj", r"\1.weight_proj.weight"),
    (r"^mlp_norm", "post_attention_layernorm"),
    (r"^attn_norm", "input_layernorm"),
    (r"^(q|k|v)_input_norm", r"\1_input_layernorm"),
)
"""transformers' ``inkling2_text`` renames of a decoder layer's tensors, in its order."""
_STORED = compile_renames(
    (r"^self_attn\.q_proj\.linear", "attn.wq_du"),
    (r"^self_attn\.k_proj\.linear", "attn.wk_dv"),
    (r"^self_attn\.v_proj\.linear", "attn.wv_dv"),
    (r"^self_attn\.q_proj\.norm\.", "attn.q_l2_clip."),
    (r"^self_attn\.(k|v)_proj\.sconv\.", r"attn.\1_sconv."),
    (r"^self_attn\.relative_position_bias\.linear", "attn.wr_du"),
    (r"^self_attn\.relative_position_bias\.norm\.", "attn.rel_l2_clip."),
    (r"^self_attn\.relative_position_bias\.", "attn.rel_logits_proj."),
    (r"^self_attn\.o_proj\.linear", "attn.wo_ud"),
    (r"^self_attn\.o_proj\.gate_proj", "attn.gate_attn"),
    (r"^self_attn\.sink_proj", "attn.attn_sink_proj"),
    (r"^self_attn\.", "attn."),
    (r"^post_attention_convolution\.", "attn_sconv."),
    (r"^post_mlp_convolution\.", "mlp_sconv."),
    (r"sconv\.conv1d\.weight$", "sconv.weight"),
    (r"sconv\.static_weight$", "sconv.static_w"),
    (r"sconv\.weight_proj\.weight$", "sconv.weight_proj"),
    (r"^post_attention_layernorm", "mlp_norm"),
    (r"^input_layernorm", "attn_norm"),
    (r"^(q|k|v)_input_layernorm", r"\1_input_norm"),
    (r"^mlp\.gate\.e_score_correction_bias$", "mlp.gate.bias"),
)
"""The inverse of :data:`_LOCAL`: a quantised checkpoint keeps the native names, which transformers renames at load
(its renames applied to runtime names would rename some again: ``sconv.weight_proj.weight.weight``)."""
_OUTSIDE = (
    ("model.llm.embed_norm.", "model.embed_tokens.embed_norm."),
    ("model.llm.embed.", "model.embed_tokens."),
    ("model.llm.norm.", "model.norm."),
    ("model.llm.attn_res.output_query", "model.final_input.query"),
    ("model.llm.unembed.", "lm_head."),
)
_QUERY = re.compile(r"^model\.llm\.attn_res\.(attn|mlp)_queries\.(\d+)$")
"""A block-residual query: ``attn_queries.{i}`` is layer ``i + 1``'s attention input's, ``mlp_queries.{i}`` layer
``i``'s MoE input's."""


def softcap(values: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(values / cap) * cap


class Inkling2TextAdapter(InterleavedW13Experts, NativeNames, FamilyAdapter):
    family = "inkling2_text"
    model_types = ("inkling2_text",)
    num_experts_keys = ("n_routed_experts",)
    has_correction_bias = True
    block_states_argument = 0
    block_states_reader = "model.final_input"

    layers_prefix = "model.llm.layers."
    local_renames = _LOCAL
    stored_renames = _STORED
    outside_prefixes = _OUTSIDE

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0

    def is_block_boundary(self, layer: int) -> bool:
        return layer % int(self.text_config.get("n_layers_per_attn_res_block", 6)) == 0

    def routing_rule(self) -> RoutingRule:
        scale = float(self.text_config.get("route_scale", 1.0))
        return RoutingRule("sigmoid_group_topk", top_k=self.top_k, normalize=True, scaling=scale)

    def activation(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        cfg = self.text_config
        dtype = up.dtype
        gate, up = gate.float(), up.float()
        out = softcap(gate, float(cfg.get("mlp_gate_softcap", 4.0))) * torch.sigmoid(gate)
        return (out * softcap(up, float(cfg.get("mlp_up_softcap", 25.0)))).to(dtype)

    # ---- the router on disk ------------------------------------------------------------------------------------
    def _router_key(self, layer: int, name: str) -> str:
        """``mlp.gate.bias`` is the correction bias; the router's logits have no bias (a name never on disk)."""
        return super()._router_key(layer, {"e_score_correction_bias": "bias", "bias": "logit_bias"}.get(name, name))

    # ---- keys and runtime names --------------------------------------------------------------------------------
    def layer_of_key(self, key: str) -> int | None:
        query = _QUERY.match(key)
        if query:
            return int(query.group(2)) + (query.group(1) == "attn")
        return super().layer_of_key(key)

    def classify_key(self, key: str):
        if _QUERY.match(key) or key.startswith("model.llm.attn_res."):
            return "attention"
        if self.layer_of_key(key) is None:
            key = self.runtime_module_name(key)
        return super().classify_key(key)

    @property
    def runtime_layers_path(self) -> str:
        return "model.layers"

    def runtime_local_key(self, layer: int, key: str) -> str:
        if _QUERY.match(key):
            return self.runtime_module_name(key)[len(f"{self.runtime_layers_path}.{layer}.") :]
        return super().runtime_local_key(layer, key)

    def runtime_module_name(self, name: str) -> str:
        query = _QUERY.match(name)
        if query:
            module = "attention_input" if query.group(1) == "attn" else "mlp_input"
            return f"{self.runtime_layers_path}.{self.layer_of_key(name)}.{module}.query"
        return super().runtime_module_name(name)

    def runtime_outside_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Runtime names; the output projection without the rows past ``unpadded_vocab_size`` (transformers'
        ``Inkling2UnpadVocab``)."""
        out = super().runtime_outside_state(state)
        rows = int(self.text_config.get("unpadded_vocab_size") or self.text_config["vocab_size"])
        if "lm_head.weight" in out:
            out["lm_head.weight"] = out["lm_head.weight"][:rows]
        return out


class Inkling2Adapter(LanguageModelAtRuntime, Inkling2TextAdapter):
    """The ``inkling2`` release: the text model under ``model.llm`` as in :class:`Inkling2TextAdapter`, at runtime
    ``model.language_model``, beside the vision tower ``model.visual`` (passed through untouched)."""

    family = "inkling2"
    model_types = ("inkling2",)
    block_states_reader = "model.language_model.final_input"

    def is_vision_key(self, key: str) -> bool:
        return key.startswith("model.visual.")

    def runtime_module_name(self, name: str) -> str:
        if self.is_vision_key(name) or self.layer_of_key(name) is not None:
            return super().runtime_module_name(name)
        name = super().runtime_module_name(name)
        return f"model.language_model.{name[len('model.') :]}" if name.startswith("model.") else name
