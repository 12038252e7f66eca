"""W4A8: INT4 group-wise weights (see :mod:`.intq`) with activations quantised to INT8 per token at inference.

A token's activations share one scale ``amax / 127``; codes are ``round(x / s)`` in -127..127. The reference
matmul below dequantises both sides and multiplies in float32: with exact float32 accumulation this equals the
integer product ``Σ_groups s_w · s_x · Σ (q_x · (q_w - z))`` an INT8 kernel computes.
"""

from __future__ import annotations

import torch

INT8_MAX = 127


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., K]`` → (int8 codes, float32 per-token scales ``[..., 1]``)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    codes = torch.round(x.float() / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the INT8 activation path computes with, in ``x``'s dtype."""
    codes, scale = quantize_activations(x)
    return (codes.float() * scale).to(x.dtype)


def w4a8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` with ``x`` quantised per token to INT8; ``weight`` is the dequantised INT4 matrix."""
    out = torch.nn.functional.linear(fake_quantize_activations(x).float(), weight.float())
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
