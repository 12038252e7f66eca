"""Which computation the plugin's quantised modules run: a Triton kernel for bf16 activations on CUDA (where
triton imports and ``MOECOMPRESS_KERNELS`` is not ``reference``), the torch reference everywhere else.

Each function returns the kernel's output, or None when the caller should run its reference forward. Which
kernel reads a scheme is the scheme's own answer (``SchemeKind.triton_linear``, ``SchemeKind.triton_moe``). Covered:

- ``QuantizedLinear``: MXFP4 and W4A8 without salient weights, binary with or without them;
- ``QuantizedExperts``: MXFP4 without salient weights, with a gated activation the kernel knows (SiLU, or
  GPT-OSS's clamped SwiGLU), biases and low-rank adapters included.

Anything that needs a gradient (the kernels have no backward) runs the reference.

What a kernel needs beyond the stored tensors (padded adapters, the salient correction) is built on the first
call and kept on the module, per device. The kernels are imported only on that path, so CPU use never
imports them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels.triton_support import use_kernels

_CACHE = "_kernel_cache"


def cached(module: torch.nn.Module, key: tuple, build) -> Any:
    cache = module.__dict__.setdefault(_CACHE, {})
    if key not in cache:
        cache.clear()
        cache[key] = build()
    return cache[key]


def _ready(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """bf16 on CUDA, and no gradient asked for (the kernels have no backward; QAT trains through the reference)."""
    if not use_kernels(x) or x.dtype != torch.bfloat16:
        return False
    return not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in module.parameters()))


def linear(module, x: torch.Tensor) -> torch.Tensor | None:
    """``QuantizedLinear.forward`` through a kernel, or None."""
    if not _ready(module, x):
        return None
    salient = "weight" in module._salient_shapes
    bias = None if module.bias is None else module.bias.to(x.dtype)
    return module.scheme.kind.triton_linear(module, x, bias, salient)


def binary_correction(module):
    """The :class:`~moecompress.kernels.triton_binary.SalientCorrection` of a binary ``QuantizedLinear``."""
    from ..kernels.triton_binary import binary_dequantize, salient_correction

    shape = (module.out_features, module.in_features)
    kept = module._salient("weight", None)
    base = binary_dequantize(module.weight.data, module.weight_scales.data, module.scheme.group_size)
    return salient_correction(kept.positions.to(base.device), kept.values.to(base.device), base, shape)


def kernel_activation(activation) -> Any:
    """The kernels' :class:`~moecompress.kernels.triton_moe.Activation` for a family adapter's ``activation``
    method (or an ``Activation`` itself); None for anything else."""
    from ..families.base import FamilyAdapter
    from ..families.swiglu_clamp import ClampedSwiGLU
    from ..kernels.triton_moe import Activation

    if isinstance(activation, Activation):
        return activation
    if isinstance(activation, ClampedSwiGLU):
        return Activation("silu") if activation.limit is None else None
    owner, function = getattr(activation, "__self__", None), getattr(activation, "__func__", None)
    if isinstance(owner, FamilyAdapter) and function is type(owner).activation:
        found = owner.fused_kernel_activation()
        return None if found is None else Activation(*found)
    return None


def experts(module, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
    """``QuantizedExperts.forward`` through the fused MXFP4 MoE kernel, or None."""
    if not _ready(module, hidden) or not module.scheme.kind.triton_moe or module._salient_shapes:
        return None
    activation = kernel_activation(module.activation)
    if activation is None:
        return None
    from ..kernels.triton_moe import fused_moe_mxfp4

    prepared = cached(module, ("mxfp4_moe", hidden.device), lambda: mxfp4_experts(module))
    return fused_moe_mxfp4(hidden, ids, weights, prepared, activation)


def _factors(module, which: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    found = {}
    for expert in range(module.num_experts):
        holder = module.lowrank._modules.get(str(expert))
        left = getattr(holder, f"{which}_L", None) if holder is not None else None
        if left is not None:
            found[expert] = (left.data, getattr(holder, f"{which}_R").data)
    return found


def mxfp4_experts(module):
    """An MXFP4 ``QuantizedExperts`` as :class:`~moecompress.kernels.triton_moe.MXFP4Experts`, adapters padded to
    one rank per kernel (gate and up share theirs)."""
    from ..kernels.triton_moe import MXFP4Experts, pad_adapters, padded_rank

    experts_count, width, inter = module.num_experts, module.hidden_size, module.intermediate_size
    gate, up, down = (_factors(module, which) for which in ("gate", "up", "down"))
    gate_up_adapters = {}
    if gate or up:
        rank = padded_rank([f[0].shape[1] for f in (*gate.values(), *up.values())])
        for name, factors in (("gate", gate), ("up", up)):
            if not factors:
                reference = next(iter((gate or up).values()))[0]
                factors = {0: (reference.new_zeros(inter, 1), reference.new_zeros(1, width))}
            gate_up_adapters[name] = pad_adapters(factors, experts_count, inter, width, rank)
    down_adapter = None
    if down:
        rank = padded_rank([f[0].shape[1] for f in down.values()])
        down_adapter = pad_adapters(down, experts_count, width, inter, rank)
    bias = module.gate_up_proj_bias
    return MXFP4Experts(
        module.gate_up_proj.data,
        module.gate_up_proj_scales.data,
        module.down_proj.data,
        module.down_proj_scales.data,
        None if bias is None else bias.data,
        None if module.down_proj_bias is None else module.down_proj_bias.data,
        gate_up_adapters.get("gate"),
        gate_up_adapters.get("up"),
        down_adapter,
    )
