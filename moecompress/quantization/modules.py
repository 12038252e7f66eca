"""Inference modules for quantised weights: they hold the packed tensors under the original parameter names and
dequantise on the fly (the torch reference path); on CUDA, :mod:`.dispatch` runs the Triton kernels instead.

The packed codes take the original parameter's name on purpose: a stock transformers install without moecompress
then sees a uint8 tensor of the wrong shape where it expects the float weight and refuses to load, instead of
silently initialising random weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ..families.base import split_gate_up
from ..kernels.w4a8 import fake_quantize_activations
from . import cpu_forward, dispatch
from .salient import VALUE_DTYPE, SalientWeights, decode_positions, expert_offsets
from .scheme import QuantizedTensor, QuantScheme

SalientSizes = dict[str, tuple[int, int]]
"""Per weight name, the stored salient bitmap's bytes and the number of salient weights."""


def _frozen(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)


class _QuantizedWeights(nn.Module):
    """Registers, for each named weight, its packed codes, scales, (asymmetric) zero points and, where the
    checkpoint has them, the salient weights' coded bitmap and values.

    The bitmap is decoded into positions once, by :meth:`decode_salient` (the plugin calls it module by module
    after loading, so no more than one module's bitmap is ever being decoded); positions live in a
    non-persistent buffer, so saving writes the coded bitmap back, never the positions.
    """

    def __init__(self, scheme: QuantScheme):
        super().__init__()
        self.scheme = scheme
        self._salient_shapes: dict[str, tuple[int, ...]] = {}
        self._salient_offsets: dict[str, list[int]] = {}
        """Per weight, where each leading index's (expert's) positions start and end in the decoded positions."""

    def _register(self, name: str, shape: tuple[int, ...], salient: tuple[int, int] | None = None) -> None:
        for suffix, (stored_shape, dtype) in self.scheme.kind.stored_shapes(self.scheme, shape).items():
            setattr(self, f"{name}{suffix}", _frozen(stored_shape, dtype))
        if salient is not None:
            stored_bytes, count = (int(v) for v in salient)
            setattr(self, f"{name}_salient", _frozen((stored_bytes,), torch.uint8))
            setattr(self, f"{name}_salient_values", _frozen((count,), VALUE_DTYPE))
            self._salient_shapes[name] = shape

    def decode_salient(self) -> None:
        """Decode every salient bitmap of this module into positions; ``ValueError`` if one is corrupt."""
        for name, shape in self._salient_shapes.items():
            values = getattr(self, f"{name}_salient_values")
            try:
                positions = decode_positions(
                    getattr(self, f"{name}_salient"), math.prod(shape), values.numel(), self.scheme.bitmap
                )
            except ValueError as error:
                raise ValueError(f"{name}_salient: {error}") from None
            self._salient_offsets[name] = expert_offsets(positions, shape[0], math.prod(shape[1:]))
            self.register_buffer(f"{name}_salient_positions", positions.to(values.device), persistent=False)

    def _salient(self, name: str, index: int | None) -> SalientWeights | None:
        shape = self._salient_shapes.get(name)
        if shape is None:
            return None
        if getattr(self, f"{name}_salient_positions", None) is None:
            self.decode_salient()
        salient = SalientWeights(
            getattr(self, f"{name}_salient_positions"), getattr(self, f"{name}_salient_values").data
        )
        if index is None:
            return salient
        return salient.of_expert(index, math.prod(shape[1:]), self._salient_offsets[name])

    def quantized(self, name: str, shape: tuple[int, ...], index: int | None = None) -> QuantizedTensor:
        """The stored weight ``name`` (or its slice ``index`` along the first dim) as a :class:`QuantizedTensor`."""
        parts = [getattr(self, name, None) for name in (name, f"{name}_scales", f"{name}_zeros")]
        if index is not None:
            parts = [None if part is None else part[index] for part in parts]
        packed, scales, zeros = parts
        return QuantizedTensor(
            self.scheme,
            shape,
            packed.data,
            scales.data,
            None if zeros is None else zeros.data,
            self._salient(name, index),
        )

    def _inputs(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quantize_activations(x) if self.scheme.activation_bits else x


class QuantizedLinear(_QuantizedWeights):
    """A drop-in for ``nn.Linear`` whose ``weight`` is stored quantised."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scheme: QuantScheme,
        dtype: torch.dtype,
        salient: SalientSizes | None = None,
    ):
        super().__init__(scheme)
        self.in_features, self.out_features = in_features, out_features
        self._register("weight", (out_features, in_features), (salient or {}).get("weight"))
        self.bias = _frozen((out_features,), dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = dispatch.linear(self, x)
        if out is not None:
            return out
        weight = self.quantized("weight", (self.out_features, self.in_features)).dequantize(x.dtype)
        return F.linear(self._inputs(x), weight, None if self.bias is None else self.bias.to(x.dtype))


class QuantizedExperts(_QuantizedWeights):
    """A drop-in for a transformers 5 fused experts module, called as ``experts(hidden [T, H], ids [T, k],
    weights [T, k])`` (or ``hidden [..., H]``, as DBRX's FFN passes its tokens), or as Llama 4's
    ``experts(scaled tokens [E * T, H])``. Weights are stored in the canonical
    orientation (``gate_up`` ``[E, 2I, H]`` gate rows first, ``down`` ``[E, H, I]``); biases, where the family has
    them, likewise. Non-gated experts (``gated=False``) hold ``up_proj`` ``[E, I, H]`` in ``gate_up_proj``'s place
    and call ``activation(None, up)``. An ``output_norm`` module (the stock experts module's ``post_expert_norm``,
    Muse Spark's) normalises each expert's output before its routing weight, as the stock module does. With
    ``one_hot_dispatch`` it is called as Switch Transformers' ``experts(hidden [T, H], dispatch [T, 1, E],
    weights [T, 1])``: a token's one-hot row names its expert, an all-zero row (past the expert's capacity) none."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        scheme: QuantScheme,
        activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        has_bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        ranks: dict[str, list[int]] | None = None,
        salient: SalientSizes | None = None,
        gated: bool = True,
        output_norm: nn.Module | None = None,
        one_hot_dispatch: bool = False,
    ):
        super().__init__(scheme)
        self.one_hot_dispatch = one_hot_dispatch
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.post_expert_norm = output_norm
        self.activation = activation
        self.in_name, self.in_rows = (
            ("gate_up_proj", 2 * intermediate_size) if gated else ("up_proj", intermediate_size)
        )
        salient = salient or {}
        self._register(self.in_name, (num_experts, self.in_rows, hidden_size), salient.get(self.in_name))
        self._register("down_proj", (num_experts, hidden_size, intermediate_size), salient.get("down_proj"))
        self.gate_up_proj_bias = _frozen((num_experts, 2 * intermediate_size), dtype) if has_bias else None
        self.down_proj_bias = _frozen((num_experts, hidden_size), dtype) if has_bias else None
        self.lowrank = ExpertAdapters(num_experts, hidden_size, intermediate_size, ranks or {}, dtype)

    def __getitem__(self, name: str) -> SimpleNamespace:
        """Switch Transformers' weight initialisation indexes its experts ``ModuleDict`` (``experts["expert_0"].wi
        .weight``) after the plugin has put this module there: it gets placeholders marked initialised, which
        transformers' ``init`` functions skip (the quantised weights come from the checkpoint)."""
        if not self.one_hot_dispatch:
            raise TypeError(f"{type(self).__name__} is not subscriptable")
        placeholder = torch.empty(0, device="meta")
        placeholder._is_hf_initialized = True
        return SimpleNamespace(wi=SimpleNamespace(weight=placeholder), wo=SimpleNamespace(weight=placeholder))

    def cache_dequantized(self, dtype: torch.dtype) -> None:
        """Keep every expert's dequantised weights in memory (non-persistent), so repeated forwards, as in
        quantisation-aware training, stop unpacking the codes each time. Costs ``dtype``-size copies of the
        experts; :meth:`drop_dequantized` frees them."""
        experts, hidden, intermediate = self.num_experts, self.hidden_size, self.intermediate_size
        gate_up = self.quantized(self.in_name, (experts, self.in_rows, hidden))
        down = self.quantized("down_proj", (experts, hidden, intermediate))
        self._dequantized = (gate_up.dequantize(dtype), down.dequantize(dtype))

    def drop_dequantized(self) -> None:
        self._dequantized = None

    def expert_weights(self, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.expert_weight(self.in_name, expert, dtype), self.expert_weight("down_proj", expert, dtype)

    def expert_weight(self, name: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``expert``'s input projection (``gate_up_proj`` or ``up_proj``) or ``down_proj``, dequantised (or
        from the cache)."""
        cached = getattr(self, "_dequantized", None)
        if cached is not None and cached[0].dtype == dtype:
            return cached[0 if name == self.in_name else 1][expert]
        inter, hidden = self.intermediate_size, self.hidden_size
        shape = (self.in_rows, hidden) if name == self.in_name else (hidden, inter)
        return self.quantized(name, shape, expert).dequantize(dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor | None = None,
        top_k_weights: torch.Tensor | None = None,
    ):
        if top_k_index is None:
            return self._forward_every_expert(hidden_states)
        if self.one_hot_dispatch:
            top_k_index, top_k_weights = _from_dispatch(top_k_index, top_k_weights)
        if hidden_states.ndim > 2:
            return self.forward(hidden_states.reshape(-1, hidden_states.shape[-1]), top_k_index, top_k_weights).reshape(
                hidden_states.shape
            )
        fused = (
            None
            if self.post_expert_norm is not None
            else dispatch.experts(self, hidden_states, top_k_index, top_k_weights)
        )
        if fused is not None:
            return fused
        out = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            if not 0 <= expert < self.num_experts:
                continue
            token, slot = torch.where(top_k_index == expert)
            expert_out = self._expert_forward(expert, hidden_states[token])
            weight = top_k_weights[token, slot, None].to(expert_out.dtype)
            out.index_add_(0, token, (expert_out * weight).to(out.dtype))
        return out

    def _forward_every_expert(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Llama 4's call: ``hidden_states`` ``[E * T, H]`` holds every token once per expert, already scaled by
        its routing weight (zero where the expert is not chosen); the output has the same layout. Rows that are
        all zero give zero (the experts have no biases), so only the chosen tokens are computed."""
        per_expert = hidden_states.reshape(self.num_experts, -1, hidden_states.shape[-1])
        out = torch.zeros_like(per_expert)
        for expert in range(self.num_experts):
            rows = torch.arange(per_expert.shape[1], device=per_expert.device)
            if self.gate_up_proj_bias is None:
                rows = per_expert[expert].any(dim=-1).nonzero().squeeze(1)
            if rows.numel():
                out[expert, rows] = self._expert_forward(expert, per_expert[expert, rows]).to(out.dtype)
        return out.reshape(hidden_states.shape)

    def _project(self, name: str, expert: int, x: torch.Tensor, fused: bool) -> torch.Tensor:
        """``x @ W[expert]ᵀ`` for weight ``name``: the fused CPU kernel where it applies, else dequantise and
        ``F.linear``."""
        out = cpu_forward.expert_linear(self, name, expert, x) if fused else None
        return F.linear(x, self.expert_weight(name, expert, x.dtype)) if out is None else out

    def _expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s output for tokens ``x`` ``[T, H]``, unweighted."""
        inter = self.intermediate_size
        fused = getattr(self, "_dequantized", None) is None and cpu_forward.fused_ready(self, x)
        gate_up = self._project(self.in_name, expert, self._inputs(x), fused)
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[expert].to(gate_up.dtype)
        gate, up = split_gate_up(gate_up, inter)
        if gate is not None:
            gate = self.lowrank.apply(expert, "gate", x, gate)
        hidden = self.activation(gate, self.lowrank.apply(expert, "up", x, up))
        down = self._project("down_proj", expert, self._inputs(hidden), fused)
        expert_out = self.lowrank.apply(expert, "down", hidden, down)
        if self.down_proj_bias is not None:
            expert_out = expert_out + self.down_proj_bias[expert].to(expert_out.dtype)
        if self.post_expert_norm is None:
            return expert_out
        if self.post_expert_norm.weight.dim() == 2:  # one weight per expert (Ergo): the norm takes the expert ids
            return self.post_expert_norm(expert_out, torch.full_like(expert_out[:, 0], expert, dtype=torch.long))
        return self.post_expert_norm(expert_out)


def _from_dispatch(dispatch: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [T, 1], weights [T, 1])`` of a one-hot dispatch ``[T, 1, E]``: a token no expert takes keeps expert 0
    with weight 0, which adds exactly nothing to its output."""
    return dispatch.argmax(dim=-1), weights * dispatch.sum(dim=-1).to(weights.dtype)


_ADAPTER_SHAPES = {"gate": ("inter", "hidden"), "up": ("inter", "hidden"), "down": ("hidden", "inter")}


class ExpertAdapters(nn.Module):
    """Low-rank error adapters ``L·R`` per expert matrix (gate ``[I, H]``, up ``[I, H]``, down ``[H, I]``), stored
    as ``lowrank.<expert>.<matrix>_L`` ``[rows, r]`` and ``_R`` ``[r, cols]`` for the matrices with ``r > 0``."""

    def __init__(self, num_experts: int, hidden: int, inter: int, ranks: dict[str, list[int]], dtype: torch.dtype):
        super().__init__()
        sizes = {"hidden": hidden, "inter": inter}
        for expert in range(num_experts):
            holder = nn.Module()
            for which, (rows, cols) in _ADAPTER_SHAPES.items():
                rank = int(ranks.get(which, [0] * num_experts)[expert])
                if rank:
                    setattr(holder, f"{which}_L", _frozen((sizes[rows], rank), dtype))
                    setattr(holder, f"{which}_R", _frozen((rank, sizes[cols]), dtype))
            if len(list(holder.parameters())):
                self.add_module(str(expert), holder)

    def apply(self, expert: int, which: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out + x·Rᵀ·Lᵀ`` when ``which`` of ``expert`` has an adapter, else ``out``."""
        holder = self._modules.get(str(expert))
        left = getattr(holder, f"{which}_L", None) if holder is not None else None
        if left is None:
            return out
        right = getattr(holder, f"{which}_R")
        return out + F.linear(F.linear(x, right.to(x.dtype)), left.to(x.dtype)).to(out.dtype)
