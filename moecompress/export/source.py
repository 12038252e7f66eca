"""Reading a moecompress native-format checkpoint layer by layer for export: the routed experts as
:class:`QuantizedTensor` s with their low-rank adapters, everything else dequantised to dense tensors under the
original on-disk names (per-expert layout), so a stock converter sees an ordinary checkpoint.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..checkpoint import CheckpointReader, group_keys_by_layer
from ..errors import UserInputError
from ..families import FamilyAdapter, MoEWeights
from ..families.base import FamilyAdapter as BaseAdapter
from ..quantization.formats.native import experts_module, written_in
from ..quantization.salient import SalientWeights, decode_positions
from ..quantization.scheme import QuantizedTensor, QuantScheme

MATRICES = ("gate", "up", "down")

_EXPONENT_BITS = {
    torch.bfloat16: (torch.int16, np.uint16, 0x7F80),
    torch.float16: (torch.int16, np.uint16, 0x7C00),
    torch.float32: (torch.int32, np.uint32, 0x7F800000),
}
_FINITE_CHUNK = 1 << 18


def holds_non_finite(tensor: torch.Tensor) -> bool:
    """Whether a floating-point tensor holds NaN or Inf (exponent bits all ones), checked in numpy a cache-sized
    chunk at a time: an export reads little float data (dense modules, integer grids' scales), too little to pay
    for loading the reader's compiled kernel."""
    layout = _EXPONENT_BITS.get(tensor.dtype)
    if layout is None:
        return tensor.is_floating_point() and tensor.element_size() > 1 and not bool(torch.isfinite(tensor).all())
    signed, unsigned, mask = layout
    bits = tensor.detach().contiguous().reshape(-1).view(signed).numpy().view(unsigned)
    mask = unsigned(mask)
    scratch = np.empty(min(_FINITE_CHUNK, bits.size), unsigned)
    for start in range(0, bits.size, _FINITE_CHUNK):
        chunk = bits[start : start + _FINITE_CHUNK]
        exponent = scratch[: chunk.size]
        np.bitwise_and(chunk, mask, out=exponent)
        if (exponent == mask).any():
            return True
    return False


@dataclass
class SourceLayer:
    """One decoder layer. ``moe`` holds the router and biases, its ``gate_up``/``down`` the dequantised experts
    (as our model computes with them, adapters not added); ``gate_up_q``/``down_q`` the stored quantised experts
    (None when the experts are not quantised)."""

    layer: int
    moe: MoEWeights | None
    rest: dict[str, torch.Tensor]
    gate_up_q: QuantizedTensor | None = None
    down_q: QuantizedTensor | None = None
    adapters: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def quant_config(config: dict[str, Any]) -> dict[str, Any] | None:
    qc = config.get("quantization_config")
    return qc if written_in(qc) else None


def check_exportable(adapter: FamilyAdapter) -> None:
    """Per-expert on-disk layout is what we write; families with another release layout are refused."""
    if type(adapter).detect_layout is not BaseAdapter.detect_layout:
        raise UserInputError(
            f"exporting a native-format {adapter.family} checkpoint is not supported "
            "(its release layout is not per-expert); quantize it with its own export format instead"
        )


class NativeSource:
    """A native-format checkpoint opened for export."""

    def __init__(self, reader: CheckpointReader, adapter: FamilyAdapter):
        self.reader, self.adapter = reader, adapter
        qc = quant_config(reader.config) or {}
        self.schemes = {key: QuantScheme.from_dict(value) for key, value in qc.get("schemes", {}).items()}
        self.modules: dict[str, str] = qc.get("modules", {})
        self.lowrank: dict[str, dict[str, list[int]]] = qc.get("lowrank", {})
        self.salient: dict[str, dict[str, list[int]]] = qc.get("salient", {})
        self.layers, self.outside = group_keys_by_layer(reader, adapter)
        self._maps: dict[str, mmap.mmap] = {}
        self.on_dense_quantized: Callable[[str, QuantizedTensor, torch.Tensor], None] | None = None

    def _read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """The reader's tensors, refused if a float one holds NaN or Inf (:func:`holds_non_finite`)."""
        tensors = self.reader.read(keys, check_finite=False)
        for key, tensor in tensors.items():
            if tensor.is_floating_point() and holds_non_finite(tensor):
                where = self.reader.directory / self.reader.tensors[key].file
                raise UserInputError(f"{where}: tensor {key!r} holds NaN or Inf values")
        return tensors

    def _mapped(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """``keys`` as tensors over a copy-on-write memory map of their shard (nothing read until used), where they
        are stored plainly in a safetensors shard; the others read (:meth:`_read`)."""
        reader, out, rest = self.reader, {}, []
        for key in keys:
            info = reader.tensors[key]
            dtype = reader.dtype_of(key)
            plain = key not in reader._encoded and info.file not in reader._pickled and not dtype.is_floating_point
            if not plain:
                rest.append(key)
                continue
            if info.file not in self._maps:
                with open(reader.directory / info.file, "rb") as handle:
                    self._maps[info.file] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            count = math.prod(info.shape) * dtype.itemsize
            raw = torch.frombuffer(self._maps[info.file], dtype=torch.uint8, count=count, offset=info.offset)
            out[key] = raw.view(dtype).reshape(info.shape)
        return {**out, **self._read(rest)}

    def _quantized(self, module: str, param: str, tensors: dict[str, torch.Tensor]) -> QuantizedTensor:
        scheme = self.schemes[self.modules[module]]
        name = f"{module}.{param}"
        packed = tensors.pop(name)
        scales = tensors.pop(f"{name}_scales")
        zeros = tensors.pop(f"{name}_zeros", None)
        shape = (*packed.shape[:-1], scheme.logical_cols(packed.shape[-1], scales.shape[-1]))
        salient = None
        if f"{name}_salient" in tensors:
            stored, values = tensors.pop(f"{name}_salient"), tensors.pop(f"{name}_salient_values")
            positions = decode_positions(stored, math.prod(shape), values.numel(), scheme.bitmap)
            salient = SalientWeights(positions, values)
        return QuantizedTensor(scheme, shape, packed, scales, zeros, salient)

    def _dense_rest(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Quantised dense modules (attention, shared experts, lm_head) dequantised to bf16, each first shown to
        :attr:`on_dense_quantized` where set; the rest as stored."""
        for key in [k for k in tensors if k.endswith(".weight") and k.removesuffix(".weight") in self.modules]:
            q = self._quantized(key.removesuffix(".weight"), "weight", tensors)
            tensors[key] = q.dequantize(torch.bfloat16)
            if self.on_dense_quantized is not None:
                self.on_dense_quantized(key, q, tensors[key])
        return tensors

    def outside_tensors(self) -> dict[str, torch.Tensor]:
        return self._dense_rest(self._read(self.outside))

    def quantized_experts_module(self, layer: int) -> str | None:
        """The layer's routed-experts module where its experts are stored quantised."""
        if not self.adapter.is_moe_layer(layer):
            return None
        experts = experts_module(self.adapter, layer)
        return experts if experts in self.modules else None

    def _expert_keys(self, layer: int) -> list[str]:
        experts = self.quantized_experts_module(layer)
        if experts is None:
            return []
        names = {f"{experts}.{p}{s}" for p in ("gate_up_proj", "down_proj") for s in QuantizedTensor.STORED_SUFFIXES}
        return [key for key in self.layers[layer] if key in names]

    def needs_fold(self, layer: int) -> bool:
        """Whether the layer's quantised experts have low-rank adapters or salient weights (:func:`fold`)."""
        experts = self.quantized_experts_module(layer)
        if experts is None:
            return False
        salient = {f"{experts}.gate_up_proj_salient", f"{experts}.down_proj_salient"}
        return any(key.startswith(f"{experts}.lowrank.") or key in salient for key in self.layers[layer])

    def quantized_experts(self, layer: int) -> tuple[QuantizedTensor, QuantizedTensor]:
        """The layer's stored quantised ``gate_up`` and ``down``, not decoded: integer tensors (codes, MXFP4 scales)
        memory-mapped, float ones (integer grids' scales) read."""
        experts = self.quantized_experts_module(layer)
        assert experts is not None
        tensors = self._mapped(self._expert_keys(layer))
        return self._quantized(experts, "gate_up_proj", tensors), self._quantized(experts, "down_proj", tensors)

    def expert_scheme(self, experts: str) -> QuantScheme:
        return self.schemes[self.modules[experts]]

    def logical_shape(self, experts: str, param: str) -> tuple[int, ...]:
        """A quantised expert tensor's dequantised shape, from the stored shapes (nothing read)."""
        packed = self.reader.tensors[f"{experts}.{param}"].shape
        scales = self.reader.tensors[f"{experts}.{param}_scales"].shape
        return (*packed[:-1], self.expert_scheme(experts).logical_cols(packed[-1], scales[-1]))

    def has_zeros(self, experts: str, param: str) -> bool:
        return f"{experts}.{param}_zeros" in self.reader.tensors

    def _unread(self, experts: str, param: str) -> torch.Tensor:
        """A quantised expert tensor's dequantised bf16 shape, on the meta device (nothing read)."""
        return torch.empty(self.logical_shape(experts, param), dtype=torch.bfloat16, device="meta")

    def layer(self, layer: int, *, experts_read: bool = True) -> SourceLayer:
        """Decoder layer ``layer``. With ``experts_read=False`` its quantised experts are neither read nor decoded:
        ``moe.gate_up``/``moe.down`` are meta tensors of their dequantised shape and ``gate_up_q``/``down_q`` None."""
        adapter = self.adapter
        skipped = set() if experts_read else set(self._expert_keys(layer))
        tensors = self._read([key for key in self.layers[layer] if key not in skipped])
        if not adapter.is_moe_layer(layer):
            return SourceLayer(layer, None, self._dense_rest(tensors))
        experts = experts_module(adapter, layer)
        router = f"{adapter.layer_prefix(layer)}{adapter.router_module}"
        out = SourceLayer(layer, None, {})
        if experts in self.modules and not experts_read:
            gate_up, down = self._unread(experts, "gate_up_proj"), self._unread(experts, "down_proj")
        elif experts in self.modules:
            out.gate_up_q = self._quantized(experts, "gate_up_proj", tensors)
            out.down_q = self._quantized(experts, "down_proj", tensors)
            gate_up, down = out.gate_up_q.dequantize(torch.bfloat16), out.down_q.dequantize(torch.bfloat16)
        else:
            gate_up, down = tensors.pop(f"{experts}.gate_up_proj"), tensors.pop(f"{experts}.down_proj")
        out.moe = MoEWeights(
            router_weight=tensors.pop(f"{router}.weight"),
            gate_up=gate_up,
            down=down,
            router_bias=tensors.pop(f"{router}.bias", None),
            correction_bias=tensors.pop(f"{router}.e_score_correction_bias", None),
            gate_up_bias=tensors.pop(f"{experts}.gate_up_proj_bias", None),
            down_bias=tensors.pop(f"{experts}.down_proj_bias", None),
            expert_ids=adapter.original_expert_ids(layer),
            layer=layer,
        )
        out.adapters = _pop_adapters(experts, tensors)
        out.rest = self._dense_rest(tensors)
        return out

    def adapters(self, layer: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """The layer's low-rank adapters alone, ``(expert, matrix) -> (L, R)`` as stored (nothing else read)."""
        experts = self.quantized_experts_module(layer)
        if experts is None:
            return {}
        keys = [key for key in self.layers[layer] if key.startswith(f"{experts}.lowrank.")]
        return _pop_adapters(experts, self._read(keys))

    def iter_layers(self) -> Iterator[SourceLayer]:
        for layer in self.layers:
            yield self.layer(layer)


def _pop_adapters(
    experts: str, tensors: dict[str, torch.Tensor]
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """``experts.lowrank.<e>.<matrix>_L`` / ``_R`` taken out of ``tensors`` as ``(e, matrix) -> (L, R)``."""
    out = {}
    prefix = f"{experts}.lowrank."
    for key in [k for k in tensors if k.startswith(prefix) and k.endswith("_L")]:
        expert, which = key[len(prefix) :].split(".")
        right = tensors.pop(key.removesuffix("_L") + "_R")
        out[(int(expert), which.removesuffix("_L"))] = (tensors.pop(key), right)
    return out


def fold(layer: SourceLayer) -> dict[str, torch.Tensor]:
    """Per fused matrix (``gate_up``, ``down``) that has adapters or salient weights: the dense float32 weights
    our model computes with, ``W_deq + L·R`` for each adapted expert (the salient weights are already in
    ``W_deq``). Matrices needing no fold are absent."""
    assert layer.moe is not None
    inter = layer.moe.intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, q in (("gate_up", layer.gate_up_q), ("down", layer.down_q)):
        matrices = ("gate", "up") if name == "gate_up" else ("down",)
        adapted = [key for key in layer.adapters if key[1] in matrices]
        if q is None or (not adapted and q.salient is None):
            continue
        dense = q.dequantize(torch.float32)
        for expert, which in adapted:
            left, right = layer.adapters[(expert, which)]
            rows = slice(0, inter) if which == "gate" else slice(inter, 2 * inter) if which == "up" else slice(None)
            dense[expert, rows] += left.float() @ right.float()
        out[name] = dense
    return out
