"""The native format: every tensor under its transformers 5 *runtime* name, quantised weights as packed codes
under the weight's own name plus ``<name>_scales`` (and ``<name>_zeros``), routed experts fused in the canonical
orientation (``gate_up_proj`` ``[E, 2I, H]`` gate rows first, ``down_proj`` ``[E, H, I]``, biases likewise).
``quantization_config`` lists every quantised module with its scheme (see :mod:`..hf_quantizer`).
"""

from __future__ import annotations

from typing import Any

import torch

from ...families import FamilyAdapter
from ..experts import QuantizedMoE
from ..hf_quantizer import QUANT_METHOD, MoecompressConfig
from ..scheme import QuantizedTensor, QuantScheme
from .base import OutputFormat, register

NAME = "native"
ADAPTER_DTYPE = torch.bfloat16
QUANTIZED_PARAMS = ("weight", "gate_up_proj", "up_proj", "down_proj")


def unsupported(adapter: FamilyAdapter, scheme: QuantScheme, targets: tuple[str, ...]) -> str | None:
    """The native format holds every scheme and target, except targets a family stores fused in a layout
    transformers splits at load (no runtime module holds the stored weight) and schemes the family's experts modules
    cannot be cut in (:meth:`~moecompress.families.FamilyAdapter.experts_refusal`)."""
    fused = sorted(set(targets) & set(getattr(adapter, "fused_on_disk_targets", ())))
    if fused:
        return (
            f"{adapter.family} stores its {', '.join(fused)} weights fused in one tensor that transformers splits at "
            "load; quantising them is not supported (quantise the experts, shared experts or lm_head)"
        )
    return adapter.experts_refusal(scheme)


def written_in(quantization: Any) -> bool:
    """Whether a ``quantization_config`` is this format's."""
    return isinstance(quantization, dict) and quantization.get("quant_method") == QUANT_METHOD


def experts_module(adapter: FamilyAdapter, layer: int) -> str:
    local = adapter.runtime_in_layer(layer, adapter.experts_module)
    return f"{adapter.layer_prefix(layer)}{adapter.stored_local_name(local)}"


def experts_modules(adapter: FamilyAdapter, layer: int) -> list[str]:
    """Every routed-experts module of layer ``layer`` as written (one, but one per expert set in ERNIE 4.5 VL)."""
    return [
        f"{adapter.layer_prefix(layer)}{adapter.stored_local_name(adapter.runtime_in_layer(layer, name))}"
        for name in adapter.experts_modules()
    ]


def runtime_key(adapter: FamilyAdapter, key: str) -> str:
    """The runtime name of an on-disk key (they differ inside Mixtral's ``block_sparse_moe``)."""
    layer = adapter.layer_of_key(key)
    if layer is None:
        return key
    return adapter.layer_prefix(layer) + adapter.stored_local_name(adapter.runtime_local_key(layer, key))


def stored(name: str, tensor: torch.Tensor | QuantizedTensor) -> dict[str, torch.Tensor]:
    return tensor.stored(name) if isinstance(tensor, QuantizedTensor) else {name: tensor}


def layer_tensors(
    adapter: FamilyAdapter,
    layer: int,
    moe: QuantizedMoE | None,
    rest: dict[str, torch.Tensor | QuantizedTensor],
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, tensor in rest.items():
        out.update(stored(runtime_key(adapter, key), tensor))
    if moe is None:
        return out
    weights = moe.weights
    prefix = adapter.layer_prefix(layer)
    router = adapter.runtime_router_state(weights)
    out.update({prefix + adapter.stored_local_name(name): tensor for name, tensor in router.items()})
    for experts, part in zip(experts_modules(adapter, layer), adapter.quantized_expert_sets(moe), strict=True):
        out.update(_experts_tensors(adapter, experts, part))
    return out


def _experts_tensors(adapter: FamilyAdapter, experts: str, moe: QuantizedMoE) -> dict[str, torch.Tensor]:
    out = moe.gate_up.stored(f"{experts}.{adapter.fused_in_name}")
    out.update(moe.down.stored(f"{experts}.down_proj"))
    weights = moe.weights
    if weights.expert_norm is not None:
        out[f"{experts}.{adapter.expert_output_norm}.weight"] = weights.expert_norm
    if weights.gate_up_bias is not None:
        out[f"{experts}.gate_up_proj_bias"] = weights.gate_up_bias
        out[f"{experts}.down_proj_bias"] = weights.down_bias
    for (expert, which), (left, right) in sorted(moe.adapters.items()):
        out[f"{experts}.lowrank.{expert}.{which}_L"] = left.to(ADAPTER_DTYPE)
        out[f"{experts}.lowrank.{expert}.{which}_R"] = right.to(ADAPTER_DTYPE)
    return out


def outside_tensors(
    adapter: FamilyAdapter, tensors: dict[str, torch.Tensor | QuantizedTensor]
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        out.update(stored(key, tensor))
    return out


def config_for(
    adapter: FamilyAdapter,
    scheme: QuantScheme,
    expert_modules: list[str],
    weight_keys: list[str],
    lowrank: dict[str, dict[str, list[int]]] | None = None,
    salient: dict[str, dict[str, list[int]]] | None = None,
) -> dict[str, Any]:
    """``quantization_config`` naming every quantised module by its runtime name."""
    modules = expert_modules + [runtime_key(adapter, key).removesuffix(".weight") for key in weight_keys]
    return MoecompressConfig(
        schemes={"default": scheme.to_dict()},
        modules=dict.fromkeys(modules, "default"),
        lowrank=lowrank,
        salient=salient,
    ).to_dict()


def salient_sizes(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, list[int]]]:
    """From a layer's written tensors, per module and weight: ``[bitmap bytes, salient weights]``."""
    sizes: dict[str, dict[str, list[int]]] = {}
    for key, bitmap in tensors.items():
        if key.endswith("_salient"):
            module, _, param = key.removesuffix("_salient").rpartition(".")
            sizes.setdefault(module, {})[param] = [bitmap.numel(), tensors[f"{key}_values"].numel()]
    return sizes


def logical_weights(key: str, info, quantization: dict[str, Any], scales) -> int | None:
    """Packed codes count the weights they decode to (the scheme tells the width from the packed and scale
    columns); scales, zero points and salient weights are metadata."""
    module, _, param = key.rpartition(".")
    scheme_key = quantization.get("modules", {}).get(module)
    if scheme_key is None:
        return None
    scheme = QuantScheme.from_dict(quantization["schemes"][scheme_key])
    if param in QUANTIZED_PARAMS:
        packed_cols = info.shape[-1] if info.shape else 0
        scales_cols = scales.shape[-1] if scales is not None and scales.shape else None
        return 0 if not packed_cols else info.numel // packed_cols * scheme.logical_cols(packed_cols, scales_cols)
    if param.endswith(("_scales", "_zeros", "_salient", "_salient_values")):
        return 0
    return None


@register
class Native(OutputFormat):
    name = NAME
    quant_method = QUANT_METHOD
    holds_salient = True
    holds_adapters = True
    needs_plugin = True
    unsupported = staticmethod(unsupported)
    layer_tensors = staticmethod(layer_tensors)
    outside_tensors = staticmethod(outside_tensors)
    config_for = staticmethod(config_for)
    logical_weights = staticmethod(logical_weights)

    def is_adapter(self, key: str) -> bool:
        return ".lowrank." in key
