"""Multi-token-prediction (MTP) layers and expert removal on stored tensors.

DeepSeek-V3/R1, Kimi-K2 and GLM-4.5 ship their MTP module as decoder layer ``num_hidden_layers`` (and up) under
``model.layers.``, counted by ``num_nextn_predict_layers``: a full decoder layer (its MoE block included) plus
``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head``. Stock transformers does not load it; servers (vLLM, SGLang)
load it for speculative decoding, so a pruned or quantised checkpoint must keep it consistent or drop it.

:func:`select_experts_stored` removes experts from a layer's tensors as stored, whatever their encoding: kept
experts' tensors (codes, scales, biases) are copied byte for byte and renumbered, fused ``[E, ...]`` tensors and
the router's rows (weight, bias, ``e_score_correction_bias``) are indexed on their first dimension.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Literal, get_args

import torch

from ..errors import OptionError, UserInputError
from ..families import FamilyAdapter
from ..vocabulary import named

MtpMode = Literal["keep", "drop"]
MTP_MODES: tuple[str, ...] = get_args(MtpMode)
MTP_COUNT_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")


def mtp_layers(adapter: FamilyAdapter, keys: list[str] | set[str]) -> list[int]:
    """Indices of the stored decoder layers past ``num_hidden_layers`` (the MTP layers)."""
    found = {layer for key in keys if (layer := adapter.layer_of_key(key)) is not None}
    return sorted(layer for layer in found if layer >= adapter.num_layers)


def outside_mtp_keys(adapter: FamilyAdapter, keys) -> frozenset[str]:
    """Keys of a top-level MTP module outside the decoder layers (Qwen3-Next's and Qwen3.5's ``mtp.*``)."""
    return frozenset(k for k in keys if adapter.layer_of_key(k) is None and k.startswith(("mtp.", "model.mtp.")))


def mtp_count(config: dict[str, Any]) -> int:
    """The MTP layer count a config declares (0 when it names none)."""
    sections = [config, *(v for v in config.values() if isinstance(v, dict))]
    return max((int(section.get(key) or 0) for section in sections for key in MTP_COUNT_KEYS), default=0)


def is_mtp_module(adapter: FamilyAdapter, name: str) -> bool:
    """Whether module ``name`` belongs to an MTP layer the config declares (a top-level ``mtp.*`` module, or a decoder
    layer from ``num_hidden_layers`` up to the declared count): stock transformers builds none of them."""
    if name.startswith(("mtp.", "model.mtp.")):
        return True
    layer = adapter.layer_of_key(name)
    return layer is not None and adapter.num_layers <= layer < adapter.num_layers + mtp_count(adapter.config)


def check_mode(mode: str) -> None:
    if mode not in MTP_MODES:
        raise OptionError(f"{named('mtp', mode)}: choose keep or drop")


def without_mtp(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its MTP layer count set to 0 (wherever a known key holds it)."""
    config = copy.deepcopy(config)
    for section in [config, *(v for v in config.values() if isinstance(v, dict))]:
        for key in MTP_COUNT_KEYS:
            if key in section:
                section[key] = 0
    return config


def select_experts_stored(
    adapter: FamilyAdapter, layer: int, tensors: dict[str, torch.Tensor], keep: list[int], num_experts: int
) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s stored tensors restricted to the experts at positions ``keep`` (renumbered 0..)."""
    block = f"{adapter.layer_prefix(layer)}{adapter.moe_disk_prefix}"
    per_expert = re.compile(re.escape(f"{block}experts.") + r"(\d+)\.(.+)$")
    router = f"{block}{adapter.router_key}."
    # Router tensors some families keep beside the router (MiniMax-M2's, ERNIE's, EXAONE's correction bias).
    named = {adapter._router_key(layer, name) for name in ("weight", "bias", "e_score_correction_bias")}
    new_index = {old: new for new, old in enumerate(keep)}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        match = per_expert.match(key)
        if match:
            old = int(match.group(1))
            if old in new_index:
                out[f"{block}experts.{new_index[old]}.{match.group(2)}"] = tensor
        elif key in named and tensor.ndim == 2 and tensor.shape[0] == 1:  # ERNIE's [1, E] correction bias
            out[key] = _rows(tensor.reshape(-1), keep).reshape(1, -1)
        elif (key.startswith(f"{block}experts.") or key.startswith(router) or key in named) and tensor.ndim >= 1:
            if tensor.shape[0] != num_experts:
                raise UserInputError(f"{key}: first dimension {tensor.shape[0]} is not the {num_experts} experts")
            out[key] = _rows(tensor, keep)
        else:
            out[key] = tensor
    return out


def _rows(tensor: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """``tensor[keep]`` through a byte view, so that any stored dtype (float8, E8M0 bytes) is copied exactly."""
    data = tensor.contiguous()
    raw = data.view(torch.uint8) if data.ndim > 1 or data.element_size() == 1 else data.view(-1, 1).view(torch.uint8)
    picked = raw.index_select(0, torch.tensor(keep, dtype=torch.long, device=raw.device)).contiguous()
    return picked.view(data.dtype).reshape(len(keep), *data.shape[1:])
