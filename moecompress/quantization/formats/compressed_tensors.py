"""The compressed-tensors export (``--format compressed-tensors``): the layout vLLM serves and llm-compressor writes,
``quantization_config = {"quant_method": "compressed-tensors", ...}`` in ``config.json``.

Every quantised ``nn.Linear`` weight ``<module>.weight`` ``[rows, cols]`` is replaced by the tensors below
(checked against compressed-tensors 0.20: ``compressors/pack_quantized``, ``naive_quantized``, ``mxfp4``).
Routed experts keep the original per-expert on-disk keys (``...experts.<e>.gate_proj`` etc.), one linear each.

``pack-quantized`` (INT4, INT2; group-wise, symmetric or asymmetric):
    ``weight_packed`` int32 ``[rows, cols·bits/32]``: 32 consecutive codes fill ``bits`` words densely, element
        ``i`` at bit ``i·bits`` of the run, the stored field being the signed code plus ``2**(bits-1)``. That field
        is our unsigned code and the bit order is our byte packing, so the words are our uint8 bytes read as
        little-endian int32.
    ``weight_scale`` ``[rows, cols/G]`` (bf16 by default; our scales are bf16 values).
    ``weight_shape`` int64 ``[2]`` = ``(rows, cols)``.
    ``weight_zero_point`` int32 ``[ceil(rows·bits/32), cols/G]``, asymmetric only: our uint8 zero points packed
        the same way but along the *output* (row) dimension. Symmetric weights store none: compressed-tensors'
        implied zero point is 0 in signed terms, ``2**(bits-1)`` in unsigned ones: ours. (Its observer's symmetric
        scale, ``amax / ((2**bits - 1) / 2)``, is ours too, before we round it up to bf16.)
    Weights dequantise as ``(q - zp) · s`` with ``q = code - 2**(bits-1)``, ``zp = z - 2**(bits-1)``: ours.

``int-quantized`` (W4A8: INT4 weights, int8 per-token dynamic activations):
    ``weight`` int8 ``[rows, cols]``: the signed codes ``code - 8`` unpacked (what compressed-tensors infers for a
        scheme with activations and what vLLM's W4A8-int linear and MoE methods load; they pack it themselves).
    ``weight_scale`` ``[rows, cols/G]``; asymmetric only ``weight_zero_point`` int8 ``[rows, cols/G]`` (``z - 8``).
    ``input_activations``: ``{num_bits: 8, type: int, symmetric: true, strategy: token, dynamic: true}``.

``mxfp4-pack-quantized`` (MXFP4): a rename.
    ``weight_packed`` uint8 ``[rows, cols/2]``: E2M1 codes, bit 3 the sign, even element in the low nibble: our
        packed bytes. ``weight_scale`` uint8 ``[rows, cols/32]``: E8M0 (exponent + 127): our scales.

Dequantisation runs in the dtype of ``weight_scale``: with the default bf16 scales compressed-tensors (and a bf16
server) yields exactly ``q.dequantize()``, whose integer weights are defined as the product rounded once to bf16.
``scale_dtype=torch.float32`` stores the same scale values wider; compressed-tensors then skips that final
rounding, so its weights differ from ours by up to half a bf16 ulp. MXFP4 values are exact in either.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ...errors import OptionError
from ...families import FamilyAdapter
from ...kernels.packing import pack_codes
from ...vocabulary import named
from ..experts import QuantizedMoE
from ..scheme import QuantizedTensor, QuantScheme
from .base import OutputFormat, register

NAME = "compressed-tensors"
QUANT_METHOD = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"
INT_QUANTIZED = "int-quantized"
MXFP4_PACK_QUANTIZED = "mxfp4-pack-quantized"
WORD_BITS = 32

# vLLM looks up a fused MoE layer's scheme under ``<experts>.0.gate_proj``/``up_proj``/``down_proj`` whatever the
# checkpoint calls them (Mixtral's w1/w3/w2), so the expert target must match those names too.
_VLLM_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


# ---- what the format can hold ---------------------------------------------------------------------------------
def compression_format(scheme: QuantScheme) -> str:
    """The compressed-tensors ``format`` that holds ``scheme``'s weights (None: none does)."""
    return scheme.kind.compressed_tensors_format


def supports(scheme: QuantScheme) -> str | None:
    """None if compressed-tensors can hold ``scheme`` exactly (every current scheme), else a one-line reason.

    What the loaders then do with it differs by scheme; see :func:`loader_caveats`.
    """
    if scheme.salient_fraction:
        return f"compressed-tensors has no salient (sparse bf16) weights; use {named('format', 'native')}"
    fmt = compression_format(scheme)
    if fmt is None:
        return f"compressed-tensors has no {scheme.kind.label or scheme.name} weights; use {named('format', 'native')}"
    if fmt == MXFP4_PACK_QUANTIZED:
        return None if scheme.group_size == 32 else f"MXFP4 blocks are 32 wide, not {scheme.group_size}"
    if not 1 <= scheme.bits <= 8:
        return f"compressed-tensors packs 1..8-bit integers, not {scheme.bits}-bit"
    if scheme.activation_bits not in (None, 8):
        return f"only int8 activations are expressed here, not {scheme.activation_bits}-bit"
    return None


def loader_caveats(scheme: QuantScheme) -> list[str]:
    """Known limits of the stock loaders for routed experts in this format (transformers 5.24 with
    compressed-tensors 0.20, and the compressed-tensors MoE methods in vLLM's main-branch source)."""
    caveats = [
        "transformers 5.24 returns dequantised experts in the dtype of weight_scale (bf16 for MXFP4), not the "
        "model's, and runs them in it"
    ]
    if scheme.activation_bits:
        caveats.append(
            "transformers 5.24 cannot load int-quantized (W4A8) MoE experts: its expert dequantiser reads "
            "weight_packed only; vLLM's W4A8-int MoE method runs on Arm CPUs only and needs symmetric weights"
        )
    elif scheme.stores_zeros:
        caveats.append(
            "transformers 5.24 cannot load asymmetric MoE experts: its expert dequantiser drops weight_zero_point"
        )
    if compression_format(scheme) == PACK_QUANTIZED and scheme.bits not in (4, 8):
        caveats.append("vLLM's fused-MoE WNA16 method takes 4- and 8-bit weights only; INT2 experts will not load")
    return caveats


# ---- config.json ---------------------------------------------------------------------------------------------
def weight_args(scheme: QuantScheme) -> dict[str, Any]:
    """The ``weights`` QuantizationArgs of ``scheme``, with only the long-standing keys (older readers forbid
    unknown ones)."""
    return {
        "num_bits": scheme.bits,
        "type": scheme.kind.number_type,
        "symmetric": not scheme.stores_zeros,
        "group_size": scheme.group_size,
        "strategy": "group",
        "dynamic": False,
        "actorder": None,
        "block_structure": None,
    }


def input_activation_args(scheme: QuantScheme) -> dict[str, Any] | None:
    """The ``input_activations`` QuantizationArgs (W4A8's per-token dynamic int8), or None for weight-only."""
    if not scheme.activation_bits:
        return None
    return {
        "num_bits": scheme.activation_bits,
        "type": "int",
        "symmetric": True,
        "group_size": None,
        "strategy": "token",
        "dynamic": True,
    }


def quantization_config(scheme: QuantScheme, targets: list[str], ignore: list[str]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config``: one config group with ``targets`` (module class names such as
    ``"Linear"``, exact module names or ``"re:"`` regexes, matched against the on-disk module names; see
    :func:`expert_targets`) minus ``ignore`` (same syntax)."""
    fmt = compression_format(scheme)
    group = {
        "targets": list(targets),
        "weights": weight_args(scheme),
        "input_activations": input_activation_args(scheme),
        "output_activations": None,
        "format": fmt,
    }
    return {
        "quant_method": QUANT_METHOD,
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }


def expert_targets(adapter: FamilyAdapter) -> list[str]:
    """The target regex for ``adapter``'s routed expert linears: its on-disk names and the gate/up/down names vLLM
    looks the fused layer up by (shared experts are not matched)."""
    names = sorted(set(adapter.expert_names) | set(_VLLM_EXPERT_NAMES))
    return [rf"re:.*\.experts\.\d+\.({'|'.join(names)})$"]


# ---- tensors -------------------------------------------------------------------------------------------------
def _module_name(weight_key: str) -> str:
    if not weight_key.endswith(".weight"):
        raise ValueError(f"{weight_key!r} is not a linear weight (its name must end in '.weight')")
    return weight_key.removesuffix(".weight")


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy with its own storage (safetensors refuses tensors that share memory)."""
    return tensor.clone(memory_format=torch.contiguous_format)


def _as_int32_words(packed: torch.Tensor) -> torch.Tensor:
    """uint8 bytes ``[..., 4·n]`` read as little-endian int32 words ``[..., n]``."""
    if packed.shape[-1] % 4:
        raise ValueError(f"{packed.shape[-1]} packed bytes per row do not fill whole 32-bit words")
    data = packed.contiguous()
    if sys.byteorder == "big":
        data = data.reshape(*data.shape[:-1], -1, 4).flip(-1).reshape(data.shape)
    return _owned(data.view(torch.int32))


def _pack_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-wide ``values`` ``[rows, n]`` packed along the rows into int32 ``[ceil(rows·bits/32), n]``
    (compressed-tensors' ``pack_to_int32(..., packed_dim=0)``: the partial last word is zero-filled)."""
    per_word = WORD_BITS // bits
    rows = values.shape[0]
    padded = torch.zeros(-(-rows // per_word) * per_word, values.shape[1], dtype=torch.uint8)
    padded[:rows] = values
    return _owned(_as_int32_words(pack_codes(padded.t(), bits)).t())


def _signed(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes or zero points shifted to compressed-tensors' signed range, ``value - 2**(bits-1)``, as int8."""
    return (values.to(torch.int16) - 2 ** (bits - 1)).to(torch.int8)


def linear_tensors(
    weight_key: str, q: QuantizedTensor, scale_dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors replacing the 2-D weight ``weight_key`` (``<module>.weight``), quantised
    as ``q``. ``scale_dtype`` (integer schemes) sets the dtype dequantisation runs in; see the module docstring."""
    if len(q.shape) != 2:
        raise ValueError(f"{weight_key}: a linear weight is 2-D, got shape {list(q.shape)}")
    module = _module_name(weight_key)
    scheme = q.scheme
    if compression_format(scheme) == MXFP4_PACK_QUANTIZED:
        return {f"{module}.weight_packed": _owned(q.packed), f"{module}.weight_scale": _owned(q.scales)}
    scale = q.scales.to(scale_dtype).contiguous()
    if scheme.activation_bits:
        out = {f"{module}.weight": _signed(q.codes(), scheme.bits), f"{module}.weight_scale": _owned(scale)}
        if q.zeros is not None:
            out[f"{module}.weight_zero_point"] = _signed(q.zeros, scheme.bits)
        return out
    out = {
        f"{module}.weight_packed": _as_int32_words(q.packed),
        f"{module}.weight_scale": _owned(scale),
        f"{module}.weight_shape": torch.tensor(q.shape, dtype=torch.int64),
    }
    if q.zeros is not None:
        out[f"{module}.weight_zero_point"] = _pack_columns(q.zeros, scheme.bits)
    return out


def fused_experts_problem(adapter: FamilyAdapter) -> str | None:
    """Why ``adapter``'s routed experts cannot be written here (they are fused on disk), or None."""
    if adapter.per_expert_linears_on_disk():
        return None
    alternative = " or ".join(["native", *filter(None, [adapter.release_format()])])
    return (
        f"{named('format', 'compressed-tensors')} writes routed experts as per-expert linears; {adapter.family} "
        f"stores them fused and stock transformers has no per-expert loader for it (use {named('format')} "
        f"{alternative})"
    )


def expert_tensors(
    adapter: FamilyAdapter,
    layer: int,
    gate_up: QuantizedTensor,
    down: QuantizedTensor,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s routed experts (canonical ``gate_up`` ``[E, 2I, H]``, gate rows first, and ``down``
    ``[E, H, I]``) as per-expert gate/up/down linears under the family's on-disk keys."""
    problem = fused_experts_problem(adapter)
    if problem:
        raise ValueError(str(OptionError(problem)))
    experts, rows, _ = gate_up.shape
    inter = down.shape[-1]
    gate_rows, up_rows = torch.arange(inter), torch.arange(inter, rows)
    out: dict[str, torch.Tensor] = {}
    for expert in range(experts):
        fused = gate_up[expert]
        parts = ((1, fused), (2, down[expert]))
        if adapter.gated_experts:
            parts = ((0, fused.take_rows(gate_rows)), (1, fused.take_rows(up_rows)), (2, down[expert]))
        for which, part in parts:
            out.update(linear_tensors(adapter._expert_key(layer, expert, which), part, scale_dtype))
    return out


# ---- the quantise pass's interface (see passes/quantize.py) --------------------------------------------------
def unsupported(adapter: FamilyAdapter, scheme: QuantScheme, targets: tuple[str, ...]) -> str | None:
    """Why this export cannot hold the request, or None."""
    if adapter.activation_varies():
        return (
            f"{named('format', 'compressed-tensors')}: {adapter.family}'s experts clamp their SwiGLU with a limit per "
            f"layer, which moecompress does not know vLLM to apply (use {named('format')} native)"
        )
    return fused_experts_problem(adapter) or supports(scheme)


def layer_tensors(
    adapter: FamilyAdapter,
    layer: int,
    moe: QuantizedMoE | None,
    rest: dict[str, torch.Tensor | QuantizedTensor],
    scale_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """A decoder layer's tensors under their on-disk names, quantised linears (``rest``) and routed experts
    (``moe``) in this format; routers, norms and biases unchanged."""
    out = outside_tensors(adapter, rest, scale_dtype)
    if moe is None:
        return out
    weights = moe.weights
    if weights.gate_up_bias is not None or weights.down_bias is not None:
        raise ValueError(f"layer {layer}: expert biases have no per-expert place in this export")
    out[adapter._router_key(layer, "weight")] = weights.router_weight
    if weights.router_bias is not None:
        out[adapter._router_key(layer, "bias")] = weights.router_bias
    if weights.correction_bias is not None:
        out[adapter._router_key(layer, "e_score_correction_bias")] = weights.correction_bias
    if weights.expert_scale is not None:
        out[adapter._router_key(layer, adapter.expert_scale_name)] = weights.expert_scale
    out.update(expert_tensors(adapter, layer, moe.gate_up, moe.down, scale_dtype))
    return out


def outside_tensors(
    adapter: FamilyAdapter,
    tensors: dict[str, torch.Tensor | QuantizedTensor],
    scale_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """``tensors`` under their on-disk names, the quantised linears among them in this format (used for the
    tensors outside the decoder layers, e.g. ``lm_head``, and for a layer's non-expert tensors)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if isinstance(tensor, QuantizedTensor):
            out.update(linear_tensors(key, tensor, scale_dtype))
        else:
            out[key] = tensor
    return out


def config_for(
    adapter: FamilyAdapter,
    scheme: QuantScheme,
    expert_modules: list[str],
    weight_keys: list[str],
    lowrank: dict | None = None,
    salient: dict | None = None,
) -> dict[str, Any]:
    """``quantization_config`` targeting the routed experts (by the per-expert on-disk names vLLM looks up) and
    every other quantised linear by its exact on-disk module name."""
    targets = expert_targets(adapter) + [key.removesuffix(".weight") for key in weight_keys]
    return quantization_config(scheme, targets, ignore=[])


_DTYPE_BITS = {"U8": 8, "I8": 8, "I32": 32, "U32": 32, "I16": 16, "U16": 16}
_METADATA = (
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "weight_global_scale",
    "weight_g_idx",
    "input_scale",
    "input_global_scale",
    "input_zero_point",
)


def _weight_bits(quantization: dict[str, Any]) -> int:
    groups = quantization.get("config_groups") or {}
    bits = {int((group.get("weights") or {}).get("num_bits", 8)) for group in groups.values()}
    if len(bits) != 1:
        raise ValueError(f"compressed-tensors config with mixed weight widths {sorted(bits)} is not supported")
    return bits.pop()


def logical_weights(key: str, info, quantization: dict[str, Any], scales) -> int | None:
    """``weight_packed`` words count the codes they pack; scales, zero points and shapes are metadata."""
    param = key.rpartition(".")[2]
    if param == "weight_packed":
        return info.numel * _DTYPE_BITS.get(info.dtype, 8) // _weight_bits(quantization)
    if param in _METADATA:
        return 0
    return None


@register
class CompressedTensors(OutputFormat):
    name = NAME
    quant_method = QUANT_METHOD
    card_tag = "compressed-tensors"
    card_note = "It is stored in the compressed-tensors format (needs the `compressed-tensors` package)."
    unsupported = staticmethod(unsupported)
    layer_tensors = staticmethod(layer_tensors)
    outside_tensors = staticmethod(outside_tensors)
    config_for = staticmethod(config_for)
    logical_weights = staticmethod(logical_weights)
