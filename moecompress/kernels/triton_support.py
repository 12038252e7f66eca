"""When the Triton kernels may run, and the few settings every kernel wrapper shares.

Kernels run on CUDA tensors when triton imports, and on CPU tensors only under the Triton interpreter
(``TRITON_INTERPRET=1``, read when a kernel module is imported, so it must be set before that). Setting
``MOECOMPRESS_KERNELS=reference`` turns them off everywhere, which is how a GPU run checks the references.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_enabled() -> bool:
    return os.environ.get("MOECOMPRESS_KERNELS", "auto") != "reference" and triton_installed()


def can_run(tensor: torch.Tensor) -> bool:
    """Whether a Triton kernel can take ``tensor``: a CUDA tensor, or any tensor under the interpreter."""
    if not kernels_enabled():
        return False
    return tensor.is_cuda or (interpreting() and tensor.device.type == "cpu")


def use_kernels(tensor: torch.Tensor) -> bool:
    """Whether the plugin's modules should call a kernel for ``tensor``: only on CUDA (the interpreter is a test
    tool, far slower than the torch reference)."""
    return tensor.is_cuda and kernels_enabled()


def dot_dtype(tensor: torch.Tensor):
    """The operand type of ``tl.dot``: bf16 on a GPU (tensor cores; bf16 × bf16 products are exact in the fp32
    accumulator), fp32 under the interpreter, whose bf16 handling is broken in triton 3.9. On a GPU the kernels
    take bf16 activations only (an fp32 ``tl.dot`` there would round its inputs to tf32)."""
    import triton.language as tl

    if tensor.device.type == "cpu":
        return tl.float32
    if tensor.dtype != torch.bfloat16:
        raise ValueError(f"the Triton kernels take bf16 activations on a GPU, got {tensor.dtype}")
    return tl.bfloat16
