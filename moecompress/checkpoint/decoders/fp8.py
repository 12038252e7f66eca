"""``fp8`` (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8, GLM-4.5-FP8, MiniMax-M2): ``X.weight`` float8_e4m3fn with
``X.weight_scale_inv`` float32 ``[ceil(out/b0), ceil(in/b1)]`` (``weight_block_size``; a scalar scale is
per-tensor); value = code x the scale of its block, partial last blocks included (as DeepSeek's own
``weight_dequant`` and vLLM compute it)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ...errors import UserInputError
from .base import ACTIVATION_SUFFIXES, Encoded, InputDecoder, InputFormat, register


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


@register
class BlockFP8(InputDecoder):
    quant_method = "fp8"

    def plan(self, qconfig: dict[str, Any], shapes, dtype: torch.dtype, read_small) -> InputFormat:
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
        dropped = frozenset(k for k in shapes if k.endswith(ACTIVATION_SUFFIXES))
        described = f"block FP8 e4m3, {list(block_size)} blocks" if block_size else "FP8 e4m3, per-tensor scales"
        return InputFormat("fp8", described, encoded, dropped)
