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


def mtp_removals(adapter: FamilyAdapter, router_bias: torch.Tensor | None, count: int, groups) -> list[int]:
    """Positions to remove from an MTP layer's experts, by the documented rule (no calibration of the MTP layer):
    the ``count`` experts with the highest ``e_score_correction_bias``. Under DeepSeek-V3's auxiliary-loss-free
    balancing that bias was raised for experts the router's affinities under-select, so a high bias marks the
    least used experts. With expert groups the same number goes from every group, as for the main layers."""
    if router_bias is None:
        raise OptionError(
            f"the MTP layer has no e_score_correction_bias to rank its experts by; pass {named('mtp', 'drop')}"
        )
    from ..passes.prune_experts import _lowest

    return _lowest(-router_bias.double(), count, groups, adapter.top_k)


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


class StoredPrune:
    """How expert pruning writes a checkpoint beyond the main layers' selection: the MTP layers' positions kept
    (or the layers dropped), the config, and for a quantised release the function that prunes stored tensors."""

    def __init__(self, keep_positions: dict[int, list[int]], config: dict[str, Any], drop_layers: frozenset[int]):
        self.keep_positions = keep_positions
        self.config = config
        self.drop_layers = drop_layers
        self.drop_keys: frozenset[str] = frozenset()
        self.report: dict[str, Any] = {}
        self.raw_layer_fn = None


def plan_stored_prune(
    model_dir, adapter: FamilyAdapter, keep_positions: dict[int, list[int]], config: dict[str, Any], mode: str, groups
) -> StoredPrune:
    """Extend the main layers' selection to the MTP layers (``mode`` keep) or drop them, and choose how the
    layers are written: as stored (byte copies of kept experts) when the input is a quantised release."""
    from .reader import CheckpointReader

    check_mode(mode)
    with CheckpointReader(model_dir, decode=False) as reader:
        layers = mtp_layers(adapter, reader.keys())
        outside = outside_mtp_keys(adapter, reader.keys())
        stored_format = reader.config.get("quantization_config") is not None
        plan = StoredPrune(dict(keep_positions), config, frozenset())
        if (layers or outside) and mode == "drop":
            plan.config = without_mtp(config)
            plan.drop_layers, plan.drop_keys = frozenset(layers), outside
            plan.report = {"mtp_layers": layers, "mode": "drop", "mtp_tensors_dropped": len(outside)}
        elif layers:
            kept_ids, per_layer = {}, {}
            main = adapter.moe_layers()
            removed_fraction = sum(
                adapter.experts_in_layer(layer) - len(keep_positions[layer]) for layer in main
            ) / sum(adapter.experts_in_layer(layer) for layer in main)
            calibrated = [layer for layer in layers if layer in keep_positions]
            for layer in (layer for layer in layers if layer not in keep_positions):
                block = f"{adapter.layer_prefix(layer)}{adapter.moe_disk_prefix}"
                bias_key = f"{block}{adapter.router_key}.e_score_correction_bias"
                bias = reader.read_raw([bias_key])[bias_key].float() if bias_key in reader.raw_tensors else None
                experts = adapter.experts_in_layer(layer)
                count = round(removed_fraction * experts)
                if groups is not None:
                    count -= count % groups.n_group
                removed = set(mtp_removals(adapter, bias, count, groups))
                plan.keep_positions[layer] = [e for e in range(experts) if e not in removed]
                original = adapter.original_expert_ids(layer)
                kept_ids[layer] = [original[e] for e in plan.keep_positions[layer]]
                per_layer[layer] = len(plan.keep_positions[layer])
            plan.config = _with_mtp_counts(adapter, config, per_layer, kept_ids)
            section = adapter._text_section(plan.config).get("moecompress") or {}
            kept_all = {str(layer): section.get("kept_experts", {}).get(str(layer)) for layer in layers}
            plan.report = {
                "mtp_layers": layers,
                "mode": "keep",
                "calibrated": calibrated,
                "kept": kept_all,
            }
            if kept_ids:
                plan.report["uncalibrated_rule"] = "highest e_score_correction_bias removed first"
        elif outside:
            plan.report = {"mode": "keep", "not_pruned": "the top-level mtp.* module has no decoder layers"}
    if stored_format:

        def raw_layer_fn(layer: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if layer not in plan.keep_positions:
                return tensors
            return select_experts_stored(
                adapter, layer, tensors, plan.keep_positions[layer], adapter.experts_in_layer(layer)
            )

        plan.raw_layer_fn = raw_layer_fn
    return plan


def _with_mtp_counts(
    adapter: FamilyAdapter, config: dict[str, Any], counts: dict[int, int], kept: dict[int, list[int]]
) -> dict[str, Any]:
    """``config`` (already pruned for the main layers) with the MTP layers' kept experts added."""
    config = copy.deepcopy(config)
    text = adapter._text_section(config)
    section = text.setdefault("moecompress", {})
    section.setdefault("kept_experts", {}).update({str(layer): ids for layer, ids in kept.items()})
    per_layer = section.get("experts_per_layer")
    if per_layer is not None:
        per_layer.update({str(layer): n for layer, n in counts.items()})
    elif any(n != int(text[adapter.num_experts_key(text)]) for n in counts.values()):
        raise OptionError(
            f"the MTP layer would keep a different expert count than the main layers; pass {named('mtp', 'drop')}"
        )
    return config


class QuantizeMtp:
    """How quantisation treats the MTP layers: dropped (and the config's count zeroed), or quantised like the main
    layers (listed in ``quantization_config``; the plugin skips the entries that name MTP modules, which stock
    transformers does not build)."""

    def __init__(self, config: dict[str, Any], drop: frozenset[int], report: dict[str, Any]):
        self.config, self.drop_layers, self.report = config, drop, report
        self.drop_keys: frozenset[str] = frozenset()


def quantize_mtp_plan(model_dir, adapter: FamilyAdapter, mode: str, calibrated: bool = False) -> QuantizeMtp:
    """The MTP plan of a quantisation; ``calibrated`` (GPTQ, salient weights, low-rank adapters need each layer's
    MoE inputs) refuses, before any work, an MTP layer whose stored tensors lack what feeds it."""
    from ..sweep.mtp import mtp_feed
    from .reader import CheckpointReader

    check_mode(mode)
    with CheckpointReader(model_dir, decode=False) as reader:
        keys = reader.keys()
        layers = mtp_layers(adapter, keys)
        outside = outside_mtp_keys(adapter, keys)
    if not layers and not outside:
        return QuantizeMtp(adapter.config, frozenset(), {})
    if mode == "drop":
        report = {"mtp_layers": layers, "mode": "drop", "mtp_tensors_dropped": len(outside)}
        plan = QuantizeMtp(without_mtp(adapter.config), frozenset(layers), report)
        plan.drop_keys = outside
        return plan
    uncalibrated = [layer for layer in layers if mtp_feed(adapter, keys, layer) is None]
    if calibrated and uncalibrated:
        from ..passes.quantize import QuantizeConfig

        raise OptionError(
            f"{model_dir}: MTP layers {uncalibrated} lack the norms and input projection that feed them, so they "
            f"cannot be calibrated; use {named('mtp', 'drop')} or {named('method', 'rtn')} without salient weights "
            "or low-rank adapters",
            QuantizeConfig,
        )
    written = "quantised like the main layers" + (", calibrated on the MTP module's own inputs" if calibrated else "")
    return QuantizeMtp(adapter.config, frozenset(), {"mtp_layers": layers, "mode": "keep", "written": written})
