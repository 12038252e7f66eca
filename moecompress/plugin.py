"""Let stock transformers classes load moecompress outputs: MoE layers with different numbers of experts or of
attention heads, and the native quantised format (registered as ``quant_method: "moecompress"``, see
:mod:`moecompress.quantization.hf_quantizer`).

A globally pruned checkpoint records its per-layer counts in the ``moecompress.experts_per_layer`` section of
the decoder's config. Importing moecompress wraps ``PreTrainedModel.post_init`` (which every transformers model
calls at the end of ``__init__``, before weights are loaded; at once when transformers' modeling code is loaded,
otherwise the moment it is) so that each such layer's MoE block is rebuilt with
its own count. Head-pruned checkpoints whose shapes stock transformers cannot build from the global counts
record ``moecompress.attention_heads_per_layer`` (query heads, KV heads); each such layer's attention module is
rebuilt the same way, with q/k norms that span the whole projection (OLMoE) resized to the projection.
Checkpoints without those sections are untouched.
"""

from __future__ import annotations

import copy
import functools
import importlib.abc
import importlib.machinery
import sys

_INSTALLED = False
_EXPERT_COUNT_ATTRIBUTES = ("num_experts", "num_local_experts", "n_routed_experts")
_MODELING_MODULE = "transformers.modeling_utils"
_MOE_BLOCK_NAMES = ("mlp", "feed_forward")
"""What a decoder layer calls its MoE block (``feed_forward``: Llama 4)."""


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
        if int(key) >= len(layers):
            continue  # a model built with fewer layers (the layer sweeps' skeleton has none)
        layer = layers[int(key)]
        name = next((name for name in _MOE_BLOCK_NAMES if hasattr(layer, name)), None)
        block = None if name is None else getattr(layer, name)
        if block is None or not _block_needs(block, count):
            continue
        layer_config = copy.copy(config)
        setattr(layer_config, attribute, int(count))
        setattr(layer, name, type(block)(layer_config))


class _LayerConfig:
    """The model's config with a few attributes overridden; everything else is read through, so later changes
    to the shared config (the attention implementation) still reach the rebuilt module."""

    def __init__(self, base, **overrides):
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name):
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        return getattr(object.__getattribute__(self, "_base"), name)


def _resize_attention(model) -> None:
    config = getattr(model, "config", None)
    section = getattr(config, "moecompress", None)
    layers = getattr(model, "layers", None)
    if not isinstance(section, dict) or not section.get("attention_heads_per_layer") or layers is None:
        return
    for key, (heads, kv_heads) in section["attention_heads_per_layer"].items():
        if int(key) >= len(layers):
            continue
        layer = layers[int(key)]
        attention = getattr(layer, "self_attn", None)
        if attention is None:
            continue
        layer_config = _LayerConfig(config, num_attention_heads=int(heads), num_key_value_heads=int(kv_heads))
        rebuilt = type(attention)(layer_config, int(key))
        for norm_name, projection_name in (("q_norm", "q_proj"), ("k_norm", "k_proj")):
            norm = getattr(rebuilt, norm_name, None)
            width = getattr(rebuilt, projection_name).out_features
            size = None if norm is None else norm.weight.numel()
            if size is not None and size not in (width, rebuilt.head_dim):
                eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
                setattr(rebuilt, norm_name, type(norm)(width, eps=eps))
        layer.self_attn = rebuilt


def _block_needs(block, count: int) -> bool:
    experts = getattr(block, "experts", None)
    return experts is not None and getattr(experts, "num_experts", count) != count


def _patch_transformers() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from transformers import PreTrainedModel

    original = PreTrainedModel.post_init

    @functools.wraps(original)
    def post_init(self, *args, **kwargs):
        _resize_moe_blocks(self)
        _resize_attention(self)
        return original(self, *args, **kwargs)

    PreTrainedModel.post_init = post_init
    from .quantization.hf_quantizer import register
    from .quantization.mxfp4_offline import install as install_mxfp4_offline

    register()
    install_mxfp4_offline()


class _LoaderThenPatch(importlib.abc.Loader):
    """transformers' own loader for ``transformers.modeling_utils``, followed by the patch."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _patch_transformers()


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODELING_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderThenPatch(spec.loader)
        return spec


def install() -> None:
    """Patch transformers once per process: now if its modeling code is loaded, else the moment it is.

    Importing ``transformers.modeling_utils`` takes about 4 s, and commands that only stream tensors
    (RTN quantisation, the kernels' benchmarks) never need it."""
    if _MODELING_MODULE in sys.modules:
        _patch_transformers()
    elif not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
