"""The gpt-oss export: MXFP4 experts as ``*_blocks`` ``[E, rows, cols/32, 16]`` and ``*_scales``
``[E, rows, cols/32]`` (E8M0), in GPT-OSS's own row order (gate and up rows interleaved), with
``quantization_config = {"quant_method": "mxfp4", ...}``. Stock transformers loads it without moecompress
(dequantising on CPU; with triton and the ``kernels`` package on GPU it runs MXFP4 natively)."""

from __future__ import annotations

from typing import Any

import torch

from ...families import FamilyAdapter
from ...vocabulary import named
from ..experts import QuantizedMoE
from ..scheme import QuantizedTensor, QuantScheme
from .base import OutputFormat, register
from .native import experts_module

NAME = "gpt-oss"
QUANT_METHOD = "mxfp4"
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def unsupported(adapter: FamilyAdapter, scheme: QuantScheme, targets: tuple[str, ...]) -> str | None:
    """Why this export cannot hold the request, or None."""
    if adapter.release_format() != NAME:
        return f"{named('format', 'gpt-oss')} is the GPT-OSS family's own layout; this model is {adapter.family}"
    if NAME not in scheme.kind.formats:
        return f"{named('format', 'gpt-oss')} holds MXFP4 only, not {named('scheme', scheme.name)}"
    if scheme.salient_fraction:
        return f"{named('format', 'gpt-oss')} has no salient weights; use {named('format', 'native')}"
    if tuple(targets) != ("experts",):
        return f"{named('format', 'gpt-oss')} quantises the routed experts only (drop {named('targets')})"
    return None


def _interleaved(rows: int) -> torch.Tensor:
    """Canonical row order (gate rows, then up rows) → GPT-OSS's (gate 0, up 0, gate 1, up 1, ...)."""
    half = rows // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)


def _blocks(q: QuantizedTensor, name: str) -> dict[str, torch.Tensor]:
    *lead, cols = q.packed.shape
    return {
        f"{name}_blocks": q.packed.reshape(*lead, cols // 16, 16).contiguous(),
        f"{name}_scales": q.scales.contiguous(),
    }


def layer_tensors(
    adapter: FamilyAdapter, layer: int, moe: QuantizedMoE | None, rest: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    out = dict(rest)
    if moe is None:
        return out
    weights = moe.weights
    router = f"{adapter.layer_prefix(layer)}{adapter.router_module}"
    out[f"{router}.weight"] = weights.router_weight
    out[f"{router}.bias"] = weights.router_bias
    experts = experts_module(adapter, layer)
    order = _interleaved(moe.gate_up.shape[-2])
    out.update(_blocks(moe.gate_up.take_rows(order), f"{experts}.gate_up_proj"))
    out[f"{experts}.gate_up_proj_bias"] = weights.gate_up_bias.index_select(-1, order).contiguous()
    out.update(_blocks(moe.down, f"{experts}.down_proj"))
    out[f"{experts}.down_proj_bias"] = weights.down_bias
    return out


def outside_tensors(adapter: FamilyAdapter, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(tensors)


def config_for(
    adapter: FamilyAdapter,
    scheme: QuantScheme,
    expert_modules: list[str],
    weight_keys: list[str],
    lowrank=None,
    salient=None,
) -> dict[str, Any]:
    return {"quant_method": QUANT_METHOD, "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT)}


def logical_weights(key: str, info, quantization: dict[str, Any], scales) -> int | None:
    """Two E2M1 weights a byte of ``*_blocks``; the E8M0 ``*_scales`` are metadata."""
    if key.endswith("_blocks"):
        return info.numel * 2
    if key.endswith("_scales"):
        return 0
    return None


@register
class GptOss(OutputFormat):
    name = NAME
    quant_method = QUANT_METHOD
    unsupported = staticmethod(unsupported)
    layer_tensors = staticmethod(layer_tensors)
    outside_tensors = staticmethod(outside_tensors)
    config_for = staticmethod(config_for)
    logical_weights = staticmethod(logical_weights)
