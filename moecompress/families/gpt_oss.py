"""GPT-OSS: a biased ``mlp.router``, experts fused on disk as ``gate_up_proj`` ``[E, H, 2I]`` with gate and up
interleaved (even columns gate, odd columns up), ``down_proj`` ``[E, I, H]``, both with biases, and a clamped
SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)``.
"""

from __future__ import annotations

import torch

from .base import FamilyAdapter, Layout, MoEWeights
from .routing import RoutingRule


class GptOssAdapter(FamilyAdapter):
    family = "gpt_oss"
    model_types = ("gpt_oss",)
    own_release_format = "gpt-oss"
    router_module = "mlp.router"
    router_key = "router"
    num_experts_keys = ("num_local_experts", "num_experts")

    def routing_rule(self) -> RoutingRule:
        return RoutingRule("topk_softmax", top_k=self.top_k)

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        limit = float(self.text_config.get("swiglu_limit", 7.0))
        alpha = float(self.text_config.get("swiglu_alpha", 1.702))
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)

    def fused_kernel_activation(self) -> tuple[str, float, float] | None:
        if type(self).activation is not GptOssAdapter.activation:
            return None
        config = self.text_config
        return ("swigluoai", float(config.get("swiglu_alpha", 1.702)), float(config.get("swiglu_limit", 7.0)))

    def detect_layout(self, layer: int, keys) -> Layout:
        if self._fused_key(layer, "gate_up_proj") in keys:
            return "fused"
        if self._fused_key(layer, "gate_up_proj_blocks") in keys:
            raise ValueError(
                f"layer {layer}: experts are stored MXFP4-quantized (*_blocks/*_scales); "
                "use a bf16 checkpoint of this model"
            )
        raise KeyError(f"layer {layer}: no expert tensors found under {self.layer_prefix(layer)}mlp.experts")

    def _pop_experts(self, layer: int, rest: dict[str, torch.Tensor], layout: Layout) -> MoEWeights:
        gate_up = rest.pop(self._fused_key(layer, "gate_up_proj"))  # [E, H, 2I] interleaved
        gate_up_bias = rest.pop(self._fused_key(layer, "gate_up_proj_bias"))  # [E, 2I] interleaved
        down = rest.pop(self._fused_key(layer, "down_proj"))  # [E, I, H]
        down_bias = rest.pop(self._fused_key(layer, "down_proj_bias"))
        canonical_gate_up = torch.cat([gate_up[:, :, 0::2], gate_up[:, :, 1::2]], dim=2).transpose(1, 2)
        canonical_bias = torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1)
        return MoEWeights(
            router_weight=torch.empty(0, device="cpu"),
            gate_up=canonical_gate_up.contiguous(),
            down=down.transpose(1, 2).contiguous(),
            gate_up_bias=canonical_bias.contiguous(),
            down_bias=down_bias,
        )

    def runtime_moe_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        """GPT-OSS's runtime layout is its on-disk layout."""
        state = {"mlp.router.weight": moe.router_weight, "mlp.router.bias": moe.router_bias}
        prefix_len = len(self._fused_key(0, ""))
        state.update(
            {f"mlp.experts.{key[prefix_len:]}": value for key, value in self._expert_tensors(0, moe, "fused").items()}
        )
        return state

    def _expert_tensors(self, layer: int, moe: MoEWeights, layout: Layout | None) -> dict[str, torch.Tensor]:
        inter = moe.intermediate_size
        experts, _, hidden = moe.gate_up.shape
        gate_up = torch.empty(experts, hidden, 2 * inter, dtype=moe.gate_up.dtype, device=moe.gate_up.device)
        gate_up[:, :, 0::2] = moe.gate_up[:, :inter].transpose(1, 2)
        gate_up[:, :, 1::2] = moe.gate_up[:, inter:].transpose(1, 2)
        bias = torch.empty(experts, 2 * inter, dtype=moe.gate_up_bias.dtype, device=moe.gate_up_bias.device)
        bias[:, 0::2] = moe.gate_up_bias[:, :inter]
        bias[:, 1::2] = moe.gate_up_bias[:, inter:]
        return {
            self._fused_key(layer, "gate_up_proj"): gate_up,
            self._fused_key(layer, "gate_up_proj_bias"): bias,
            self._fused_key(layer, "down_proj"): moe.down.transpose(1, 2).contiguous(),
            self._fused_key(layer, "down_proj_bias"): moe.down_bias,
        }
