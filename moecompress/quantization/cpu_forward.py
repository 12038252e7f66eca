"""How the plugin's routed experts multiply on CPU, choosing per expert by its token count:

- bf16 inputs, up to :data:`REPACKED_MAX_TOKENS` tokens: torch's packed-INT4 matmul
  (:mod:`moecompress.kernels.int4pack`) on a repacked copy of the module's experts, built for the whole module on
  its first such forward and kept beside the stored codes (see :func:`repacked` for its memory);
- other float inputs, up to :data:`FUSED_MAX_TOKENS`: the fused numba kernels of
  :mod:`moecompress.kernels.cpu_matmul`, which read the 4-bit codes once and never write a dequantised matrix;
- more tokens: dequantise the expert's matrix (one numba pass) and call the same matmul the original model uses,
  whose cost the dequantisation then amortises.

Covered: MXFP4 and 4-bit integer weights (INT4, W4A8) without salient weights, on CPU, when no gradient is
asked for (QAT trains through the reference) and ``MOECOMPRESS_KERNELS`` is not ``reference``.
``MOECOMPRESS_CPU_REPACK=0`` skips the repacked copy (and its memory). Everything else takes the reference path:
dequantise, then ``F.linear``.
"""

from __future__ import annotations

import os

import torch

from ..kernels import cpu_matmul, int4pack

FUSED_MAX_TOKENS = {"mxfp4": 8, "int4": 4}
"""Tokens per expert up to which the fused numba kernel is used. Its cost is one decode of the matrix plus a dot
product per token, the alternative's one dequantisation plus a bf16 matmul that barely grows with the tokens
(AMX); the crossover, timed on one Qwen3-30B-A3B expert's gate_up on the 2-core development machine, lies near
these counts."""

REPACKED_MAX_TOKENS = {"mxfp4": 8, "int4": 20}
"""Tokens per expert up to which the packed-INT4 matmul is used. Timed on one thread against dequantise +
``F.linear`` for one Qwen3-30B-A3B expert (gate_up 1536 x 2048 and down 2048 x 768 together): MXFP4 (two
4-bit halves) 1.2 against 2.25 ms at 4 tokens, even at 8; INT4 group 128 1.85 against 2.5 ms at 16, 2.8 against
2.55 ms at 24."""


def _kind(scheme) -> str | None:
    return scheme.kind.cpu_matmul


def _repack_allowed(module, x: torch.Tensor) -> bool:
    return (
        x.dtype == torch.bfloat16
        and os.environ.get("MOECOMPRESS_CPU_REPACK", "1") != "0"
        and module.scheme.group_size in int4pack.GROUP_SIZES
        and int4pack.available()
    )


def fused_ready(module, x: torch.Tensor) -> bool:
    """Whether ``module``'s weights can go through a fast CPU route for ``x``."""
    if x.device.type != "cpu" or not x.dtype.is_floating_point:
        return False
    if os.environ.get("MOECOMPRESS_KERNELS", "auto") == "reference" or _kind(module.scheme) is None:
        return False
    if not (cpu_matmul.available() or _repack_allowed(module, x)):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters())):
        return False
    return True


def _stored(module, name: str) -> tuple[torch.Tensor, ...]:
    parts = (getattr(module, name), getattr(module, f"{name}_scales"), getattr(module, f"{name}_zeros", None))
    return tuple(part.data for part in parts if part is not None)


def repacked(module, name: str) -> list[int4pack.Int4Packed]:
    """Every expert's weight ``name`` in the packed-INT4 layout, built on first use and kept on the module
    (not a parameter or buffer: never saved, never moved).

    Memory, on top of the stored codes: INT4 ``0.5 + 4 / G`` bytes per weight (group 128: 0.53, so the experts'
    memory doubles); MXFP4 ``1.25`` bytes per weight (its two halves and bf16 scales: 2.4 times the stored 0.53,
    1.78 with it, still less than bf16's 2). Building it takes about 3 ms (INT4) or 30 ms (MXFP4) per
    Qwen3-30B-A3B expert on one thread. Rebuilt when a stored tensor is replaced; :func:`drop_repacked` frees it
    (and must follow writing the stored codes in place)."""
    stored = _stored(module, name)
    key = tuple(part.data_ptr() for part in stored)
    cache = module.__dict__.setdefault("_repacked", {})
    if name not in cache or cache[name][0] != key:
        cache.pop(name, None)
        packed, scales, *zeros = stored
        if _kind(module.scheme) == "mxfp4":
            experts = [int4pack.from_mxfp4(packed[e], scales[e]) for e in range(packed.shape[0])]
        else:
            zero = zeros[0] if zeros else None
            group = module.scheme.group_size
            experts = [
                int4pack.from_int4(packed[e], scales[e], None if zero is None else zero[e], group)
                for e in range(packed.shape[0])
            ]
        cache[name] = (key, experts)
    return cache[name][1]


def drop_repacked(module) -> None:
    module.__dict__.pop("_repacked", None)


def expert_linear(module, name: str, expert: int, x: torch.Tensor) -> torch.Tensor | None:
    """``x @ W[expert]ᵀ`` for the stored weight ``name`` through the packed-INT4 matmul or the fused kernel, or
    None when the caller should dequantise (too many tokens, salient weights, or a module :func:`fused_ready`
    refuses)."""
    kind = _kind(module.scheme)
    if kind is None or name in module._salient_shapes:
        return None
    tokens = x.shape[0]
    if tokens <= REPACKED_MAX_TOKENS[kind] and _repack_allowed(module, x):
        return int4pack.linear(x, repacked(module, name)[expert])
    if tokens > FUSED_MAX_TOKENS[kind] or not cpu_matmul.available():
        return None
    packed = getattr(module, name).data[expert]
    scales = getattr(module, f"{name}_scales").data[expert]
    if kind == "mxfp4":
        return cpu_matmul.mxfp4_linear(x, packed, scales)
    zeros = getattr(module, f"{name}_zeros", None)
    return cpu_matmul.int4_linear(
        x, packed, scales, None if zeros is None else zeros.data[expert], module.scheme.group_size
    )
