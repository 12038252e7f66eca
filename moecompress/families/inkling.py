"""Inkling (``inkling_text``; ``inkling_mm_model`` with its vision and audio towers): shared experts routed together
with the routed ones.

The router ``mlp.gate.weight`` ``[E + S, H]`` scores the ``n_routed_experts`` routed experts, then the
``n_shared_experts`` shared ones. The choice is the top-k of the routed experts' sigmoid scores plus
``mlp.gate.e_score_correction_bias`` ``[E]``; the k chosen and the S shared experts are weighted together, each by
the sigmoid of its logit over their sum, times ``route_scale`` and the router's learnt ``mlp.gate.global_scale``. So
removing a routed expert changes the shared experts' weights too. The view holds the shared experts as router columns
past the routed ones (as LongCat-Flash's identity experts are: :attr:`MoEWeights.identity_experts`, chosen for every
token, never pruned, merged or quantised as experts), with their weights read from the layer's own tensors (which
stay there, dense, written as read), and the correction bias padded with zeros over their columns while in the view.
The decoder layer adds a short convolution after the MoE block (``mlp_sconv``), outside the MoE output.

Layouts: ``inkling_text`` as ``save_pretrained`` writes it (``model.layers.{i}.mlp.experts.gate_up_proj`` ``[E, 2I,
H]``, ``mlp.shared_experts.{gate,up,down}_proj`` ``[S, I, H]``/``[S, H, I]``); the ``inkling_mm_model`` release under
its native names (transformers' ``inkling_mm_model`` conversion rules, reversed by ``save_pretrained``):
``model.llm.layers.{i}``, ``attn.{wq_du,wk_dv,wv_dv,wr_du,wo_ud}``, ``attn_norm``/``mlp_norm``, fused experts
``mlp.experts.w13_weight`` ``[E, 2I, H]`` with gate and up rows interleaved and ``w2_weight``, shared
``mlp.shared_experts.shared_w13_weight`` (interleaved) and ``shared_w2_weight``, the correction bias as
``mlp.gate.bias``, ``model.llm.{embed,embed_norm,norm,unembed}``, towers ``model.visual.*`` and ``model.audio.*``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F

from .base import FamilyAdapter, Layout, MoEWeights
from .interleaved_experts import InterleavedW13Experts, interleaved_halves
from .native_names import NativeNames, compile_renames
from .rerouted_block import StockBlockRerouted
from .routing import RoutingRule
from .vision_language import LanguageModelAtRuntime


@dataclass
class InklingWeights(MoEWeights):
    """The view of an Inkling MoE block: :class:`MoEWeights` plus what its shared columns and weights need (read
    from the layer's tensors, which keep them)."""

    global_scale: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    """``[S, I, H]``; ``shared_up`` the same, ``shared_down`` ``[S, H, I]``."""
    shared_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None


class InklingTextAdapter(StockBlockRerouted, FamilyAdapter):
    family = "inkling_text"
    model_types = ("inkling_text",)
    num_experts_keys = ("n_routed_experts",)
    shared_expert_markers = ("shared_experts.",)
    has_correction_bias = True
    correction_bias_on_disk = "e_score_correction_bias"
    """The router tensor that holds the correction bias on disk (the release's ``mlp.gate.bias``: the router has no
    bias of its own)."""

    @property
    def n_shared(self) -> int:
        return int(self.text_config.get("n_shared_experts") or 0)

    def is_moe_layer(self, layer: int) -> bool:
        return self.listed_moe_layer(layer, True)

    def identity_experts(self, layer: int) -> int:
        return self.n_shared

    def routing_rule(self) -> RoutingRule:
        scale = float(self.text_config.get("route_scale", 1.0))
        return RoutingRule("sigmoid_shared_topk", top_k=self.top_k, scaling=scale, shared=self.n_shared)

    def check_expert_pruning(self, source: str = "model", config: Any = None) -> None:
        from ..errors import UserInputError

        if not self.n_shared:
            raise UserInputError(f"{source}: {self.family} with n_shared_experts 0 is not supported")

    # ---- shared experts on disk ----------------------------------------------------------------------------
    def _shared_key(self, layer: int, name: str) -> str:
        return f"{self.layer_prefix(layer)}mlp.shared_experts.{name}"

    def shared_weights(self, layer: int, rest: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s shared experts' gate, up and down weights from its tensors."""
        return tuple(rest[self._shared_key(layer, name)] for name in ("gate_proj", "up_proj", "down_proj"))

    def split_layer(
        self, layer: int, tensors: dict[str, torch.Tensor], *, consume: bool = False
    ) -> tuple[MoEWeights | None, dict[str, torch.Tensor], Layout | None]:
        moe, rest, layout = super().split_layer(layer, tensors, consume=consume)
        if moe is None:
            return moe, rest, layout
        gate, up, down = self.shared_weights(layer, rest)
        view = InklingWeights(
            **{item.name: getattr(moe, item.name) for item in fields(moe)},
            global_scale=rest[self._router_key(layer, "global_scale")],
            shared_gate=gate,
            shared_up=up,
            shared_down=down,
        )
        if self.correction_bias_on_disk == "bias":
            view.correction_bias, view.router_bias = view.router_bias, None
        bias = view.correction_bias
        if bias is not None and bias.shape[0] == view.num_experts:
            view.correction_bias = torch.cat([bias, bias.new_zeros(self.n_shared)])
        return view, rest, layout

    def _unpadded(self, moe: MoEWeights) -> MoEWeights:
        bias = moe.correction_bias
        if bias is None or bias.shape[0] == moe.num_experts:
            return moe
        return replace(moe, correction_bias=bias[: moe.num_experts].contiguous())

    def join_layer(
        self, layer: int, moe: MoEWeights | None, rest: dict[str, torch.Tensor], layout: Layout | None
    ) -> dict[str, torch.Tensor]:
        return super().join_layer(layer, None if moe is None else self._unpadded(moe), rest, layout)

    def runtime_router_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        return super().runtime_router_state(self._unpadded(moe))

    # ---- computation --------------------------------------------------------------------------------------
    def route(
        self,
        moe: MoEWeights,
        logits: torch.Tensor,
        allowed: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule's ids ``[T, k + S]`` (shared experts last) and weights, times the router's ``global_scale``."""
        ids, weights = super().route(moe, logits, allowed, token_ids)
        scale = getattr(moe, "global_scale", None)
        return ids, weights if scale is None else weights * scale.to(weights.device).float()

    def expert_output(self, moe: MoEWeights, expert: int, hidden: torch.Tensor) -> torch.Tensor:
        if expert < moe.num_experts:
            return super().expert_output(moe, expert, hidden)
        shared = expert - moe.num_experts
        gate, up, down = (w[shared].to(hidden) for w in (moe.shared_gate, moe.shared_up, moe.shared_down))
        return F.linear(self.activation(F.linear(hidden, gate), F.linear(hidden, up)), down)

    # ---- the stock router ---------------------------------------------------------------------------------
    def route_of(self, output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stock router returns ``(routed logits, routed weights, ids, shared weights)``."""
        return output[0], output[1], output[2]

    def with_route(self, output: Any, weights: torch.Tensor, ids: torch.Tensor) -> Any:
        """``weights`` and ``ids`` in the view's form (``[T, k + S]``, shared last) as the stock router's output."""
        k = output[2].shape[-1]
        weights = weights.to(output[1].dtype)
        shared = weights[:, k:].contiguous() if weights.shape[-1] > k else output[3]
        return output[0], weights[:, :k].contiguous(), ids[:, :k], shared

    def reroute_hooks(self, layer_module, choose):
        """The choice is made on all ``E + S`` logits, which the stock router does not return: they are computed
        from its input as it computes them."""

        def reroute(router, inputs, output):
            hidden = inputs[0]
            logits = F.linear(hidden.reshape(-1, hidden.shape[-1]).float(), router.weight.float())
            ids, weights = choose(logits)
            return self.with_route(output, weights, ids)

        return [layer_module.get_submodule(self.router_module).register_forward_hook(reroute)]

    def stock_route(self, model: torch.nn.Module, layer: int, hidden: torch.Tensor):
        """The stock router's ``(logits [T, E + S], weights [T, k + S], ids [T, k + S])``, shared experts last."""
        router = self.router_of(model, layer)
        _, weights, ids, shared = router(hidden)
        routed = router.weight.shape[0] - self.n_shared
        shared_ids = torch.arange(routed, routed + self.n_shared, device=ids.device).expand(ids.shape[0], -1)
        logits = F.linear(hidden.float(), router.weight.float())
        return logits, torch.cat([weights, shared], dim=-1), torch.cat([ids, shared_ids], dim=-1)


_LOCAL = compile_renames(
    (r"^attn\.wq_du\.", "self_attn.q_proj."),
    (r"^attn\.wk_dv\.", "self_attn.k_proj."),
    (r"^attn\.wv_dv\.", "self_attn.v_proj."),
    (r"^attn\.wr_du\.", "self_attn.r_proj."),
    (r"^attn\.wo_ud\.", "self_attn.o_proj."),
    (r"^attn\.(k|v)_sconv\.", r"self_attn.\1_sconv.conv1d."),
    (r"^attn\.", "self_attn."),
    (r"^(attn|mlp)_sconv\.", r"\1_sconv.conv1d."),
    (r"^attn_norm\.", "input_layernorm."),
    (r"^mlp_norm\.", "post_attention_layernorm."),
    (r"^mlp\.w2_md\.", "mlp.down_proj."),
    (r"^mlp\.shared_experts\.shared_w2_weight$", "mlp.shared_experts.down_proj"),
    (r"^mlp\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
)
"""transformers' ``inkling_mm_model`` renames of a decoder layer's tensors (the one-to-one ones)."""
_SPLIT = (
    ("mlp.w13_dn.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), 0),
    ("mlp.shared_experts.shared_w13_weight", ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"), 1),
)
"""Tensors transformers splits at load: the dense MLP's and the shared experts' interleaved gate and up rows."""
_OUTSIDE = (
    ("model.llm.embed_norm.", "model.language_model.embed_tokens.embed_norm."),
    ("model.llm.embed.", "model.language_model.embed_tokens."),
    ("model.llm.norm.", "model.language_model.norm."),
    ("model.llm.unembed.", "lm_head."),
)


class InklingAdapter(LanguageModelAtRuntime, NativeNames, InterleavedW13Experts, InklingTextAdapter):
    """The ``inkling_mm_model`` release: the text model under ``model.llm`` in its native names, beside the vision
    (``model.visual``) and audio (``model.audio``) towers, which are passed through untouched."""

    family = "inkling_mm_model"
    model_types = ("inkling_mm_model",)
    layers_prefix = "model.llm.layers."
    correction_bias_on_disk = "bias"
    local_renames = _LOCAL
    outside_prefixes = _OUTSIDE

    def is_vision_key(self, key: str) -> bool:
        return key.startswith(("model.visual.", "model.audio."))

    def _router_key(self, layer: int, name: str) -> str:
        return super()._router_key(layer, "bias" if name == "e_score_correction_bias" else name)

    # ---- the interleaved shared experts ------------------------------------------------------------------------
    def shared_weights(self, layer: int, rest: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        gate, up = interleaved_halves(rest[self._shared_key(layer, "shared_w13_weight")], 1)
        return gate, up, rest[self._shared_key(layer, "shared_w2_weight")]

    # ---- runtime names -----------------------------------------------------------------------------------------
    def runtime_local_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = dict(state)
        for disk, (gate, up), dim in _SPLIT:
            if disk in state:
                state[gate], state[up] = interleaved_halves(state.pop(disk), dim)
        return state

    def classify_key(self, key: str):
        if self.layer_of_key(key) is None and not self.is_vision_key(key):
            key = self.runtime_module_name(key)
        return super().classify_key(key)
