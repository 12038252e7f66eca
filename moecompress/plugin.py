"""Let stock transformers classes load moecompress outputs: MoE layers with different numbers of experts, and
the native quantised format (registered as ``quant_method: "moecompress"``, see
:mod:`moecompress.quantization.hf_quantizer`).

A globally pruned checkpoint records its per-layer counts in the ``moecompress.experts_per_layer`` section of
the decoder's config. Importing moecompress wraps ``PreTrainedModel.post_init`` (which every transformers model
calls at the end of ``__init__``, before weights are loaded) so that each such layer's MoE block is rebuilt with
its own count. Checkpoints without that section are untouched.
"""

from __future__ import annotations

import copy
import functools

_INSTALLED = False
_EXPERT_COUNT_ATTRIBUTES = ("num_experts", "num_local_experts", "n_routed_experts")


def _resize_moe_blocks(model) -> None:
    config = getattr(model, "config", None)
    section = getattr(config, "moecompress", None)
    layers = getattr(model, "layers", None)
    if not isinstance(section, dict) or not section.get("experts_per_layer") or layers is None:
        return
    attribute = next((name for name in _EXPERT_COUNT_ATTRIBUTES if hasattr(config, name)), None)
    if attribute is None:
        return
    for key, count in section["experts_per_layer"].items():
        layer = layers[int(key)]
        block = getattr(layer, "mlp", None)
        if block is None or not _block_needs(block, count):
            continue
        layer_config = copy.copy(config)
        setattr(layer_config, attribute, int(count))
        layer.mlp = type(block)(layer_config)


def _block_needs(block, count: int) -> bool:
    experts = getattr(block, "experts", None)
    return experts is not None and getattr(experts, "num_experts", count) != count


def install() -> None:
    """Wrap ``PreTrainedModel.post_init`` once per process."""
    global _INSTALLED
    if _INSTALLED:
        return
    from transformers import PreTrainedModel

    original = PreTrainedModel.post_init

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        _resize_moe_blocks(self)
        return original(self, *args, **kwargs)

    PreTrainedModel.post_init = post_init
    from .quantization.hf_quantizer import register

    register()
    _INSTALLED = True
