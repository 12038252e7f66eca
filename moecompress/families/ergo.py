"""Ergo (``ergo``): non-gated experts (up, squared ReLU, down), each RMS-normalising its own output with a weight of
its own (``post_expert_norm`` ``[E, H]``) before its routing weight; a sigmoid router whose choice adds
``e_score_correction_bias``, weights renormalised and scaled by ``moe_routed_scaling_factor``; a shared expert with
its own output norm; dense squared-ReLU MLPs in the ``dense`` layers of ``mlp_layer_types``.

The release is in the layout Ergo's training framework exports (transformers renames it at load,
``conversion_mapping.py``), without ``model.``: ``tok_embeddings``, ``norm``, ``output``, and per layer
``attention.{wqkv,wo,q_norm,k_norm}``, ``attention_norm``, ``post_attention_norm``, ``ffn_norm``, ``post_ffn_norm``,
``post_{attention,ffn}_residual.scale``, ``feed_forward.{up,down}`` (dense), and for a MoE layer the fused experts
stored transposed, ``feed_forward.up_proj`` ``[E, H, I]`` and ``feed_forward.down_proj`` ``[E, I, H]``, the router
``feed_forward.gate_kernel`` ``[H, E]`` (transposed) and ``feed_forward.router_bias``, the experts' norm weights
``feed_forward.expert_output_norm.scale`` ``[E, H]`` (the view's :attr:`~.base.MoEWeights.expert_norm`), and the
shared expert ``feed_forward.shared_{up,down}_proj`` (``[in, out]``) and ``shared_expert_output_norm.scale``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import FamilyAdapter, Layout, MoEWeights, ParamClass
from .native_names import apply_renames, compile_renames
from .routing import RoutingRule
from .transposed_experts import TransposedFusedExperts

_LOCAL_RENAMES = compile_renames(
    (r"^attention_norm\.", "input_layernorm."),
    (r"^post_attention_norm\.", "post_attention_layernorm."),
    (r"^ffn_norm\.", "pre_feedforward_layernorm."),
    (r"^post_ffn_norm\.", "post_feedforward_layernorm."),
    (r"^post_attention_residual\.scale$", "attention_residual_gate.weight"),
    (r"^post_ffn_residual\.scale$", "feedforward_residual_gate.weight"),
    (r"^attention\.wqkv\.", "self_attn.qkv_proj."),
    (r"^attention\.wo\.", "self_attn.o_proj."),
    (r"^attention\.(q|k)_norm\.", r"self_attn.\1_norm."),
    (r"^feed_forward\.up\.", "mlp.up_proj."),
    (r"^feed_forward\.down\.", "mlp.down_proj."),
    (r"^feed_forward\.shared_expert_output_norm\.scale$", "mlp.shared_experts.norm.weight"),
)
"""transformers' ``ergo`` renames on a layer's local keys (the transposing ones are in :meth:`runtime_local_state`)."""
_TRANSPOSED_SHARED = {
    "feed_forward.shared_up_proj": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared_down_proj": "mlp.shared_experts.down_proj.weight",
}
_OUTSIDE_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_DISK_EXPERTS = {"gate_up_proj": "up_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


class ErgoAdapter(TransposedFusedExperts, FamilyAdapter):
    family = "ergo"
    model_types = ("ergo",)
    layers_prefix = "layers."
    moe_disk_prefix = "feed_forward."
    router_module = "mlp.gate"
    num_experts_keys = ("num_experts",)
    shared_expert_markers = ("shared_",)
    has_correction_bias = True
    gated_experts = False
    router_transposed = True
    expert_output_norm = "post_expert_norm"
    runtime_layers_path = "model.layers"

    def is_moe_layer(self, layer: int) -> bool:
        return self.listed_moe_layer(layer, layer >= int(self.text_config.get("num_dense_blocks", 1)))

    def routing_rule(self) -> RoutingRule:
        scaling = float(self.text_config.get("moe_routed_scaling_factor", 8**0.5))
        return RoutingRule("sigmoid_group_topk", top_k=self.top_k, scaling=scaling)

    def activation(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        return torch.relu(up).square()

    def expert_output(self, moe: MoEWeights, expert: int, hidden: torch.Tensor) -> torch.Tensor:
        """The expert's output RMS-normalised in float32 with its own weight, as the stock experts module does."""
        out = super().expert_output(moe, expert, hidden)
        eps = float(self.text_config.get("rms_norm_eps", 1e-12))
        normed = F.rms_norm(out.float(), (out.shape[-1],), eps=eps) * moe.expert_norm[expert].float()
        return normed.to(out.dtype)

    # ---- on-disk names ---------------------------------------------------------------------------------
    def _fused_key(self, layer: int, name: str) -> str:
        return f"{self.layer_prefix(layer)}{self.moe_disk_prefix}{_DISK_EXPERTS[name]}"

    def _router_key(self, layer: int, name: str) -> str:
        name = {"weight": "gate_kernel", "e_score_correction_bias": "router_bias"}.get(name, f"no_router_{name}")
        return f"{self.layer_prefix(layer)}{self.moe_disk_prefix}{name}"

    def _norm_key(self, layer: int) -> str:
        return f"{self.layer_prefix(layer)}{self.moe_disk_prefix}expert_output_norm.scale"

    def detect_layout(self, layer: int, keys) -> Layout:
        if self._fused_key(layer, "up_proj") in keys:
            return "fused_transposed"
        raise KeyError(f"layer {layer}: no expert tensors found under {self.layer_prefix(layer)}feed_forward")

    def split_layer(
        self, layer: int, tensors: dict[str, torch.Tensor], *, consume: bool = False
    ) -> tuple[MoEWeights | None, dict[str, torch.Tensor], Layout | None]:
        from ..checkpoint.reader import materialise

        router = self._router_key(layer, "weight")
        if self.is_moe_layer(layer) and router in tensors:
            tensors = dict(tensors, **{router: materialise(tensors[router]).T.contiguous()})
            norm = tensors.pop(self._norm_key(layer), None)
        else:
            norm = None
        moe, rest, layout = super().split_layer(layer, tensors, consume=consume)
        if moe is not None:
            if norm is None:
                from ..errors import UserInputError

                raise UserInputError(f"{self._norm_key(layer)}: missing (each Ergo expert has an output norm)")
            moe.expert_norm = materialise(norm)
        return moe, rest, layout

    def join_layer(
        self, layer: int, moe: MoEWeights | None, rest: dict[str, torch.Tensor], layout: Layout | None
    ) -> dict[str, torch.Tensor]:
        out = super().join_layer(layer, moe, rest, layout)
        if moe is not None:
            router = self._router_key(layer, "weight")
            out[router] = out[router].T.contiguous()
            out[self._norm_key(layer)] = moe.expert_norm
        return out

    def classify_key(self, key: str) -> ParamClass:
        layer = self.layer_of_key(key)
        if layer is None:
            return "embeddings" if key in ("tok_embeddings.weight", "output.weight") else super().classify_key(key)
        local = key[len(self.layer_prefix(layer)) :]
        if local in ("feed_forward.gate_kernel", "feed_forward.router_bias"):
            return "router"
        if local in ("feed_forward.up_proj", "feed_forward.down_proj", "feed_forward.expert_output_norm.scale"):
            return "experts"
        if local.startswith("attention."):
            return "attention"
        return super().classify_key(key)

    # ---- the loaded transformers model ------------------------------------------------------------------
    def runtime_local_name(self, local_key: str) -> str:
        return apply_renames(_LOCAL_RENAMES, local_key)

    def runtime_local_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = dict(state)
        for disk, runtime in _TRANSPOSED_SHARED.items():
            if disk in state:
                state[runtime] = state.pop(disk).T.contiguous()
        return state

    def runtime_outside_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_OUTSIDE_NAMES.get(key, key): value for key, value in state.items()}

    def runtime_moe_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        """The runtime experts keep the on-disk orientation (``up_proj`` ``[E, H, I]``), and their norm weights."""
        state = {
            f"{self.experts_module}.up_proj": moe.gate_up.transpose(1, 2).contiguous(),
            f"{self.experts_module}.down_proj": moe.down.transpose(1, 2).contiguous(),
            f"{self.experts_module}.post_expert_norm.weight": moe.expert_norm,
        }
        state.update(self.runtime_router_state(moe))
        return state

    def runtime_router_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        return {
            f"{self.router_module}.linear.weight": moe.router_weight,
            f"{self.router_module}.e_score_correction_bias": moe.correction_bias,
        }
