"""How the plugin's routed experts multiply on CPU: few tokens per expert (decode, most of a prefill) go through
the fused dequantise-and-multiply kernels of :mod:`moecompress.kernels.cpu_matmul`, which read the 4-bit codes
once and never write a dequantised matrix; more tokens than that dequantise the expert's matrix (one numba pass)
and call the same bf16 matmul the original model uses, whose cost the dequantisation then amortises.

Covered: MXFP4 and 4-bit integer weights (INT4, W4A8) without salient weights, on CPU, when no gradient is
asked for (QAT trains through the reference) and ``MOECOMPRESS_KERNELS`` is not ``reference``. Everything else
takes the reference path: dequantise, then ``F.linear``.
"""

from __future__ import annotations

import os

import torch

from ..kernels import cpu_matmul

FUSED_MAX_TOKENS = {"mxfp4": 8, "int4": 4}
"""Tokens per expert up to which the fused kernel is used. Its cost is one decode of the matrix plus a dot product
per token, the alternative's one dequantisation plus a bf16 matmul that barely grows with the tokens (AMX); the
crossover, timed on one Qwen3-30B-A3B expert's gate_up on the 2-core development machine, lies near these
counts."""


def _kind(scheme) -> str | None:
    if scheme.is_float:
        return "mxfp4"
    if not scheme.is_binary and scheme.bits == 4:
        return "int4"
    return None


def fused_ready(module, x: torch.Tensor) -> bool:
    """Whether ``module``'s weights can go through a fused CPU kernel for ``x``."""
    if x.device.type != "cpu" or not x.dtype.is_floating_point or not cpu_matmul.available():
        return False
    if os.environ.get("MOECOMPRESS_KERNELS", "auto") == "reference" or _kind(module.scheme) is None:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters())):
        return False
    return True


def expert_linear(module, name: str, expert: int, x: torch.Tensor) -> torch.Tensor | None:
    """``x @ W[expert]ᵀ`` for the stored weight ``name`` through the fused kernel, or None when the caller
    should dequantise (too many tokens, salient weights, or a module :func:`fused_ready` refuses)."""
    kind = _kind(module.scheme)
    if kind is None or x.shape[0] > FUSED_MAX_TOKENS[kind] or name in module._salient_shapes:
        return None
    packed = getattr(module, name).data[expert]
    scales = getattr(module, f"{name}_scales").data[expert]
    if kind == "mxfp4":
        return cpu_matmul.mxfp4_linear(x, packed, scales)
    zeros = getattr(module, f"{name}_zeros", None)
    return cpu_matmul.int4_linear(
        x, packed, scales, None if zeros is None else zeros.data[expert], module.scheme.group_size
    )
