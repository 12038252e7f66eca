"""GPT-OSS's MXFP4 layout (``quant_method: mxfp4``: our ``--format gpt-oss`` export and the released gpt-oss
checkpoints) loading without the network.

With triton and the ``kernels`` package installed, transformers' MXFP4 quantizer fetches the hub kernel
``kernels-community/gpt-oss-triton-kernels`` (and, with ``kernels`` >= 0.19, refuses it without remote-code
trust), so such a checkpoint cannot load offline. After ``import moecompress`` the quantizer dequantises to bf16
instead whenever no GPU is in use (CPU inference computes with the dequantised weights anyway) or the Hub is
offline (``HF_HUB_OFFLINE``); with a GPU and the Hub reachable, transformers' own choice stands.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)
_PATCHED = False


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _gpu_in_use() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())


def should_dequantize() -> bool:
    return not _gpu_in_use() or _offline()


def install() -> None:
    """Wrap the MXFP4 quantizer's environment check (once per process)."""
    global _PATCHED
    if _PATCHED:
        return
    try:
        from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer
    except ImportError:
        return
    original = Mxfp4HfQuantizer.validate_environment

    @functools.wraps(original)
    def validate_environment(self, *args, **kwargs):
        if self.pre_quantized and not self.quantization_config.dequantize and should_dequantize():
            logger.info("MXFP4 checkpoint: dequantising to bf16 (no GPU in use, or the Hub is offline)")
            self.quantization_config.dequantize = True
        return original(self, *args, **kwargs)

    Mxfp4HfQuantizer.validate_environment = validate_environment
    _PATCHED = True
