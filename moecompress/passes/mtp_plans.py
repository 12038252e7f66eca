"""What the passes do with multi-token-prediction (MTP) layers: the pruning's plan (the main layers' selection
extended to the MTP layers by a documented rule, or the layers dropped; stored tensors kept as stored for quantised
releases) and the quantisation's (the layers dropped, or quantised like the main layers). The checkpoint side, which
layers are MTP layers and how experts are removed from stored tensors, is :mod:`moecompress.checkpoint.mtp`."""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..checkpoint.mtp import check_mode, mtp_layers, outside_mtp_keys, select_experts_stored, without_mtp
from ..checkpoint.reader import CheckpointReader
from ..errors import OptionError
from ..families import FamilyAdapter
from ..sweep.mtp import mtp_feed
from ..vocabulary import named
from .prune_experts import lowest_positions
from .quantize import QuantizeConfig


def mtp_removals(adapter: FamilyAdapter, router_bias: torch.Tensor | None, count: int, groups) -> list[int]:
    """Positions to remove from an MTP layer's experts, by the documented rule (no calibration of the MTP layer):
    the ``count`` experts with the highest ``e_score_correction_bias``. Under DeepSeek-V3's auxiliary-loss-free
    balancing that bias was raised for experts the router's affinities under-select, so a high bias marks the
    least used experts. With expert groups the same number goes from every group, as for the main layers."""
    if router_bias is None:
        raise OptionError(
            f"the MTP layer has no e_score_correction_bias to rank its experts by; pass {named('mtp', 'drop')}"
        )
    return lowest_positions(-router_bias.double(), count, groups, adapter.top_k)


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
        raise OptionError(
            f"{model_dir}: MTP layers {uncalibrated} lack the norms and input projection that feed them, so they "
            f"cannot be calibrated; use {named('mtp', 'drop')} or {named('method', 'rtn')} without salient weights "
            "or low-rank adapters",
            QuantizeConfig,
        )
    written = "quantised like the main layers" + (", calibrated on the MTP module's own inputs" if calibrated else "")
    return QuantizeMtp(adapter.config, frozenset(), {"mtp_layers": layers, "mode": "keep", "written": written})
