"""``mxfp4`` (gpt-oss as released): ``X_blocks`` uint8 ``[E, rows, cols/32, 16]`` (E2M1 pairs, even element in
the low nibble) and ``X_scales`` uint8 E8M0 ``[E, rows, cols/32]`` decode to ``X`` ``[E, cols, rows]`` (the bf16
release's orientation, as transformers' ``convert_moe_packed_tensors`` returns it)."""

from __future__ import annotations

from typing import Any

import torch

from ...errors import UserInputError
from .base import Encoded, InputDecoder, InputFormat, register

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


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


@register
class GptOssMXFP4(InputDecoder):
    quant_method = "mxfp4"

    def plan(self, qconfig: dict[str, Any], shapes, dtype: torch.dtype, read_small) -> InputFormat:
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
