"""Quantised release layouts decoded on read: which raw tensors make up one logical weight, and how to decode them.

A quantised release stores a weight as several tensors (codes and scales). :func:`plan_decoding` maps each
logical key (the name the weight has in the bf16 release) to an :class:`Encoded` that names those raw tensors;
the reader then presents the logical key with the decoded values, so passes see a bf16 checkpoint. Formats:

- ``fp8`` (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8, GLM-4.5-FP8, MiniMax-M2): ``X.weight`` float8_e4m3fn with
  ``X.weight_scale_inv`` float32 ``[ceil(out/b0), ceil(in/b1)]`` (``weight_block_size``; a scalar scale is
  per-tensor); value = code x the scale of its block, partial last blocks included (as DeepSeek's own
  ``weight_dequant`` and vLLM compute it).
- ``mxfp4`` (gpt-oss as released): ``X_blocks`` uint8 ``[E, rows, cols/32, 16]`` (E2M1 pairs, even element in
  the low nibble) and ``X_scales`` uint8 E8M0 ``[E, rows, cols/32]`` decode to ``X`` ``[E, cols, rows]`` (the bf16
  release's orientation, as transformers' ``convert_moe_packed_tensors`` returns it).
- ``compressed-tensors``: ``pack-quantized`` integers (``weight_packed`` int32, 32 codes in ``num_bits`` words,
  ``weight_scale``, ``weight_shape``, optional packed ``weight_zero_point``) and ``float-quantized`` FP8
  (``weight`` float8 with ``weight_scale`` per tensor, channel, group or block); value = (code - zero point) x
  scale, computed in the scale's dtype as compressed-tensors' ``dequantize`` does, then cast. Activation scales
  are dropped. Its FP4 formats (NVFP4, MXFP4) are refused.

A checkpoint written by moecompress in its native format (``quant_method: moecompress``) is not decoded here:
:func:`native_refusal` names it so that prune and quantize can refuse it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UserInputError

Decoder = Callable[[dict[str, torch.Tensor]], torch.Tensor]

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
NATIVE_METHOD = "moecompress"
_ACTIVATION_SUFFIXES = ("input_scale", "input_global_scale", "activation_scale", "output_scale", "k_scale", "v_scale")


@dataclass(frozen=True)
class Encoded:
    """One logical weight stored as ``parts`` (raw keys, the codes first), decoded to ``shape`` by ``decode``
    (which gets the parts by their suffix after the logical key's module, e.g. ``weight_scale_inv``)."""

    parts: dict[str, str]
    shape: tuple[int, ...]
    decode: Decoder


@dataclass(frozen=True)
class InputFormat:
    """What a checkpoint's weights are stored as: ``name`` for reports, and the decoding plan."""

    name: str
    description: str
    encoded: dict[str, Encoded]
    dropped: frozenset[str]
    """Raw keys that are neither decoded nor passed through (static activation scales)."""

    @property
    def raw_keys(self) -> set[str]:
        return {key for enc in self.encoded.values() for key in enc.parts.values()} | set(self.dropped)


def quant_method(config: dict[str, Any]) -> str | None:
    """The config's ``quantization_config.quant_method`` (top level or in the text config)."""
    sections = [config, *(v for v in config.values() if isinstance(v, dict))]
    for section in sections:
        method = (section.get("quantization_config") or {}).get("quant_method")
        if method:
            return str(method)
    return None


def quantization_config(config: dict[str, Any]) -> dict[str, Any]:
    sections = [config, *(v for v in config.values() if isinstance(v, dict))]
    return next((s["quantization_config"] for s in sections if s.get("quantization_config")), {})


def target_dtype(config: dict[str, Any]) -> torch.dtype:
    """The dtype a quantised release dequantises to: its config's ``dtype``/``torch_dtype`` (bf16 if unset)."""
    sections = [config, *(v for v in config.values() if isinstance(v, dict))]
    for section in sections:
        name = section.get("dtype") or section.get("torch_dtype")
        if isinstance(name, str) and name in ("bfloat16", "float16", "float32"):
            return getattr(torch, name)
    return torch.bfloat16


def native_refusal(config: dict[str, Any], source: str) -> None:
    """A :class:`UserInputError` for a checkpoint moecompress wrote in its native quantised format."""
    if quant_method(config) == NATIVE_METHOD:
        raise UserInputError(f"{source}: already quantised by moecompress (native format); use the original checkpoint")


def plan_decoding(
    config: dict[str, Any],
    shapes: dict[str, tuple[tuple[int, ...], str]],
    read_small: Callable[[str], torch.Tensor],
) -> InputFormat | None:
    """The decoding plan of a checkpoint (``shapes``: raw key → (shape, safetensors dtype name); ``read_small``
    reads a small raw tensor such as ``weight_shape``), or None for a plain one (no ``quantization_config``, or
    one that only moecompress's native plugin reads)."""
    method = quant_method(config)
    if method is None or method == NATIVE_METHOD:
        return None
    qconfig = quantization_config(config)
    dtype = target_dtype(config)
    if method == "fp8":
        return _plan_fp8(qconfig, shapes, dtype)
    if method == "mxfp4":
        return _plan_mxfp4(shapes, dtype)
    if method == "compressed-tensors":
        return _plan_compressed_tensors(qconfig, shapes, dtype, read_small)
    raise UserInputError(
        f"quantization_config.quant_method {method!r} is not a layout moecompress reads "
        "(fp8, mxfp4, compressed-tensors); start from the bf16 release"
    )


# ---- block FP8 ------------------------------------------------------------------------------------------
def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``weight`` (float8, ``[..., rows, cols]``) times the scale of each element's block, in float32, cast to
    ``dtype``. A scale with one element is per-tensor."""
    values = weight.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    if scale.numel() == 1:
        return (values * scale.reshape(())).to(dtype)
    rows, cols = values.shape[-2:]
    expected = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale.shape[-2:]) != expected:
        raise UserInputError(
            f"FP8 scale grid {list(scale.shape)} does not match weight {list(weight.shape)} in blocks {list(block)}"
        )
    scale = scale.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (values * scale).to(dtype)


def _plan_fp8(qconfig: dict[str, Any], shapes, dtype: torch.dtype) -> InputFormat:
    block_size = qconfig.get("weight_block_size") or None
    block = (int(block_size[0]), int(block_size[1])) if block_size else (1 << 62, 1 << 62)
    encoded: dict[str, Encoded] = {}
    for key, (shape, name) in shapes.items():
        if name not in ("F8_E4M3", "F8_E5M2"):
            continue
        scale_key = f"{key}_scale_inv"
        if scale_key not in shapes:
            raise UserInputError(f"{key}: FP8 weight without its {scale_key.rsplit('.', 1)[-1]} tensor")

        def decode(parts, block=block):
            return dequantize_block_fp8(parts["codes"], parts["scale"], block, dtype)

        encoded[key] = Encoded({"codes": key, "scale": scale_key}, shape, decode)
    dropped = frozenset(k for k in shapes if k.endswith(_ACTIVATION_SUFFIXES))
    described = f"block FP8 e4m3, {list(block_size)} blocks" if block_size else "FP8 e4m3, per-tensor scales"
    return InputFormat("fp8", described, encoded, dropped)


# ---- gpt-oss MXFP4 --------------------------------------------------------------------------------------
def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """E2M1 codes, two per byte with the even element in the low nibble, as float32, last dim doubled."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed.device)
    bytes_ = packed.view(torch.uint8).to(torch.long)
    values = torch.stack([lut[bytes_ & 0xF], lut[bytes_ >> 4]], dim=-1)
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_gpt_oss_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``*_blocks`` ``[..., rows, G, 16]`` and E8M0 ``*_scales`` ``[..., rows, G]`` → ``[..., G·32, rows]``."""
    values = unpack_fp4(blocks)  # [..., rows, G, 32]
    exponent = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponent.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).transpose(-1, -2).contiguous().to(dtype)


def _plan_mxfp4(shapes, dtype: torch.dtype) -> InputFormat:
    encoded: dict[str, Encoded] = {}
    for key, (shape, _) in shapes.items():
        if not key.endswith("_blocks"):
            continue
        logical = key.removesuffix("_blocks")
        scale_key = f"{logical}_scales"
        if scale_key not in shapes or len(shape) < 3:
            raise UserInputError(f"{key}: MXFP4 blocks without a matching {scale_key.rsplit('.', 1)[-1]} tensor")
        *lead, rows, groups, width = shape
        decoded_shape = (*lead, groups * width * 2, rows)
        encoded[logical] = Encoded(
            {"codes": key, "scale": scale_key},
            decoded_shape,
            lambda parts: dequantize_gpt_oss_mxfp4(parts["codes"], parts["scale"], dtype),
        )
    return InputFormat("mxfp4", "gpt-oss MXFP4 (E2M1 blocks of 32, E8M0 scales)", encoded, frozenset())


# ---- compressed-tensors ---------------------------------------------------------------------------------
def unpack_int32_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """compressed-tensors' dense packing: element i of a row at bit i·bits of the row's little-endian int32
    words; returned as the signed codes (unsigned minus 2^(bits-1)), ``count`` per row, as int32."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    rows = words.shape[:-1]
    nwords = words.shape[-1]
    bits_per_row = torch.zeros(*rows, nwords * 32, dtype=torch.int64, device=packed.device)
    shifts = torch.arange(32, dtype=torch.int64, device=packed.device)
    bits_per_row.view(*rows, nwords, 32).copy_((words.unsqueeze(-1) >> shifts) & 1)
    needed = count * bits
    stream = bits_per_row[..., :needed].reshape(*rows, count, bits)
    codes = (stream << torch.arange(bits, dtype=torch.int64, device=packed.device)).sum(-1)
    return (codes - (1 << (bits - 1))).to(torch.int32)


def _ct_groups(qconfig: dict[str, Any]) -> list[dict[str, Any]]:
    groups = []
    for group in (qconfig.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        groups.append({"format": group.get("format") or qconfig.get("format"), "weights": weights})
    return groups


def _ct_weight_args(qconfig: dict[str, Any], fmt: str, dtype_name: str) -> dict[str, Any]:
    """The weight arguments of the config group that fits a tensor stored as ``fmt`` (``int``/``float``)."""
    wanted = "int" if fmt == "int" else "float"
    candidates = [g["weights"] for g in _ct_groups(qconfig) if (g["weights"].get("type") or "int") == wanted]
    if not candidates:
        raise UserInputError(f"compressed-tensors: no config group with {wanted} weights for a {dtype_name} tensor")
    return candidates[0]


def _ct_dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, args: dict[str, Any]
) -> torch.Tensor:
    """(codes - zero) x scale in the scale's dtype, broadcast by the scale's shape (tensor, channel, group, block)."""
    compute = scale.dtype
    rows, cols = codes.shape[-2:]
    values = codes.to(compute)
    strategy = args.get("strategy") or ""
    if scale.numel() == 1:
        scale_full = scale.reshape(())
        zero_full = None if zero is None else zero.reshape(()).to(compute)
    elif strategy == "block" or (args.get("block_structure") and scale.ndim >= 2 and scale.shape[-1] != cols):
        height, width = (int(v) for v in args["block_structure"])

        def expand(t: torch.Tensor) -> torch.Tensor:
            t = t.repeat_interleave(height, dim=-2)[..., :rows, :]
            return t.repeat_interleave(width, dim=-1)[..., :cols]

        scale_full = expand(scale)
        zero_full = None if zero is None else expand(zero.to(compute))
    else:
        group = cols // scale.shape[-1] if scale.ndim >= 2 else cols
        scale_full = scale.reshape(*scale.shape[:-1], -1, 1) if scale.ndim >= 2 else scale.reshape(-1, 1, 1)
        values = values.unflatten(-1, (cols // group, group))
        zero_full = None
        if zero is not None:
            zero_full = zero.to(compute).reshape(scale_full.shape)
        if zero_full is not None:
            values = values - zero_full
        return (values * scale_full).flatten(-2)
    if zero_full is not None:
        values = values - zero_full
    return values * scale_full


def _plan_compressed_tensors(qconfig: dict[str, Any], shapes, dtype: torch.dtype, read_small) -> InputFormat:
    encoded: dict[str, Encoded] = {}
    formats: set[str] = set()
    for key, (shape, name) in shapes.items():
        module, _, param = key.rpartition(".")
        prefix = f"{module}." if module else ""
        logical = f"{prefix}weight"
        if param == "weight_packed":
            if name != "I32":
                raise UserInputError(
                    f"{key}: compressed-tensors FP4 weights (nvfp4/mxfp4-pack-quantized) are not read yet; "
                    "start from the bf16 release"
                )
            parts = {"codes": key, "scale": f"{prefix}weight_scale", "weight_shape": f"{prefix}weight_shape"}
            if f"{prefix}weight_zero_point" in shapes:
                parts["weight_zero_point"] = f"{prefix}weight_zero_point"
            for part in ("scale", "weight_shape"):
                if parts[part] not in shapes:
                    raise UserInputError(f"{key}: pack-quantized weight without its {parts[part]} tensor")
            args = _ct_weight_args(qconfig, "int", name)
            bits = int(args.get("num_bits") or 4)
            group = args.get("group_size") if (args.get("strategy") or "group") == "group" else None
            if group and len(shape) == 2:  # no read needed: (rows, scale columns x group)
                rows, cols = shape[0], shapes[parts["scale"]][0][-1] * int(group)
            else:
                rows, cols = (int(v) for v in read_small(parts["weight_shape"]).tolist())
            formats.add(f"pack-quantized INT{bits}")
            encoded[logical] = Encoded(parts, (rows, cols), _pack_quantized_decoder(args, bits, dtype))
        elif param == "weight" and name in ("F8_E4M3", "F8_E5M2"):
            parts = {"codes": key, "scale": f"{prefix}weight_scale"}
            if parts["scale"] not in shapes:
                raise UserInputError(f"{key}: FP8 weight without its weight_scale tensor")
            args = _ct_weight_args(qconfig, "float", name)
            formats.add("float-quantized FP8")
            encoded[logical] = Encoded(parts, tuple(shape), _float_decoder(args, dtype))
    dropped = frozenset(k for k in shapes if k.endswith(_ACTIVATION_SUFFIXES))
    return InputFormat("compressed-tensors", "compressed-tensors " + ", ".join(sorted(formats)), encoded, dropped)


def _pack_quantized_decoder(args: dict[str, Any], bits: int, dtype: torch.dtype) -> Decoder:
    def decode(parts: dict[str, torch.Tensor]) -> torch.Tensor:
        rows, cols = (int(v) for v in parts["weight_shape"].tolist())
        scale = parts["scale"]
        codes = unpack_int32_codes(parts["codes"], bits, cols).reshape(rows, cols)
        zero = parts.get("weight_zero_point")
        if zero is not None:
            zero = unpack_int32_codes(zero.transpose(0, 1).contiguous(), bits, rows).transpose(0, 1)
            zero = zero.reshape(scale.shape)
        return _ct_dequantize(codes, scale, zero, args).to(dtype)

    return decode


def _float_decoder(args: dict[str, Any], dtype: torch.dtype) -> Decoder:
    def decode(parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return _ct_dequantize(parts["codes"], parts["scale"], None, args).to(dtype)

    return decode


def describe_input(model_dir) -> dict[str, Any]:
    """What a checkpoint's weights are stored as, for a pass's report."""
    from .reader import CheckpointReader

    with CheckpointReader(model_dir) as reader:
        found = reader.input_format
        if found is None:
            return {"format": "unquantised", "description": "floating-point weights as stored"}
        return {"format": found.name, "description": found.description, "decoded_to": str(target_dtype(reader.config))}
