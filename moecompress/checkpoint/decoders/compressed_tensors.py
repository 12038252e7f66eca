"""``compressed-tensors``: ``pack-quantized`` integers (``weight_packed`` int32, 32 codes in ``num_bits`` words,
``weight_scale``, ``weight_shape``, optional packed ``weight_zero_point``) and ``float-quantized`` FP8 (``weight``
float8 with ``weight_scale`` per tensor, channel, group or block); value = (code - zero point) x scale, computed in
the scale's dtype as compressed-tensors' ``dequantize`` does, then cast. Activation scales are dropped. Its FP4
formats (NVFP4, MXFP4) are refused."""

from __future__ import annotations

from typing import Any

import torch

from ...errors import UserInputError
from .base import ACTIVATION_SUFFIXES, Decoder, Encoded, InputDecoder, InputFormat, register


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


@register
class CompressedTensors(InputDecoder):
    quant_method = "compressed-tensors"

    def plan(self, qconfig: dict[str, Any], shapes, dtype: torch.dtype, read_small) -> InputFormat:
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
        dropped = frozenset(k for k in shapes if k.endswith(ACTIVATION_SUFFIXES))
        return InputFormat("compressed-tensors", "compressed-tensors " + ", ".join(sorted(formats)), encoded, dropped)
