"""Calibration of a multi-token-prediction (MTP) layer: the MoE inputs it sees on the calibration data.

An MTP module predicts token i+2 from the main model's last hidden state h_i and the embedding of token i+1:
``x_i = proj([norm_e(embed(t_{i+1})); norm_h(h_i)])``, then a full decoder layer (its own attention and MoE block)
on x. h_i is what the main model returns, after its final norm (what vLLM's and SGLang's MTP drafters receive from
the target model). Two stored styles (embedding first in both, as vLLM's ``deepseek_mtp`` and ``qwen3_next_mtp`` /
``qwen3_5_mtp`` concatenate):

- DeepSeek-V3, Kimi-K2, GLM-4.5: decoder layer ``num_hidden_layers + k`` holds ``enorm``, ``hnorm``, ``eh_proj``
  (and ``embed_tokens``, ``shared_head``); layer k+1 takes layer k's output as it is.
- Qwen3-Next, Qwen3.5: top-level ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.fc`` and
  ``mtp.layers.{k}`` (numbered ``num_hidden_layers + k`` by the adapter); the main embedding is shared, and layer
  k+1 takes layer k's output through ``mtp.norm``.

The norms are the family's own (the final norm's module class: DeepSeek's RMSNorm, Qwen's ``1 + weight`` RMSNorm).
The last position of each window has no next token; its input is computed with a zero embedding (so the causal
attention of the other positions is that of the full window) and left out of the capture.
"""

from __future__ import annotations

import copy
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..checkpoint.mtp import mtp_layers
from ..families import FamilyAdapter
from .engine import CalibrationSweep, LayerCapture, _attention_received

MTP_EXTRAS = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")


@dataclass(frozen=True)
class MtpFeed:
    """The stored keys of what feeds one MTP layer."""

    embed: str
    norm_embedding: str
    norm_hidden: str
    projection: str
    output_norm: str | None
    """The norm between chained MTP layers (Qwen's ``mtp.norm``); None: the output is passed on as it is."""


def mtp_feed(adapter: FamilyAdapter, keys: Collection[str], layer: int) -> MtpFeed | None:
    """What feeds MTP layer ``layer``, or None when its stored tensors lack it (it cannot be calibrated)."""
    keys = set(keys)
    prefix = adapter.layer_prefix(layer)
    main_embed = next(
        (k for k in sorted(keys) if k.endswith("embed_tokens.weight") and adapter.layer_of_key(k) is None), None
    )
    if all(f"{prefix}{name}.weight" in keys for name in ("enorm", "hnorm", "eh_proj")):
        embed = f"{prefix}embed_tokens.weight" if f"{prefix}embed_tokens.weight" in keys else main_embed
        if embed is None:
            return None
        return MtpFeed(embed, f"{prefix}enorm.weight", f"{prefix}hnorm.weight", f"{prefix}eh_proj.weight", None)
    module = prefix[: prefix.find("layers.")] if prefix.startswith(("mtp.", "model.mtp.")) else None
    names = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc")
    if module and main_embed and all(f"{module}{name}.weight" in keys for name in names):
        output = f"{module}norm.weight" if f"{module}norm.weight" in keys else None
        return MtpFeed(main_embed, *(f"{module}{name}.weight" for name in names), output)
    return None


def calibrates_mtp(sweep: CalibrationSweep, layer: int) -> bool:
    """Whether ``layer``'s stored tensors hold what the MTP module needs (its norms and input projection)."""
    return mtp_feed(sweep.adapter, sweep.reader.keys(), layer) is not None


def _final_norm_path(adapter: FamilyAdapter) -> str:
    """The main model's final norm module (``model.norm``, ``model.language_model.norm``)."""
    return f"{adapter.runtime_layers_path.rpartition('.')[0]}.norm"


def _norm(sweep: CalibrationSweep, weight: torch.Tensor) -> torch.nn.Module:
    """The family's norm module (the class of its final norm) with ``weight``."""
    module = copy.deepcopy(sweep._meta_model.get_submodule(_final_norm_path(sweep.adapter)))
    module.load_state_dict({"weight": weight.to(sweep.dtype)}, strict=True, assign=True)
    return module.eval()


def mtp_captures(sweep: CalibrationSweep, batches: list[dict[str, torch.Tensor]]):
    """A :class:`LayerCapture` per MTP layer that :func:`calibrates_mtp`, after ``sweep.run`` has finished (it
    needs ``sweep.last_hidden``). Several MTP layers are chained: layer k+1 takes layer k's output (through the
    module's output norm where it has one) as its hidden state and the embedding one token further on. With
    ``sweep.keep_tensors`` each capture also holds the layer's other tensors and layout, for a writer."""
    adapter = sweep.adapter
    keys = sweep.reader.keys()
    feeds = {layer: mtp_feed(adapter, keys, layer) for layer in mtp_layers(adapter, keys)}
    layers = [layer for layer, feed in feeds.items() if feed is not None]
    if not layers:
        return
    final = _norm(sweep, sweep.reader.tensor(f"{_final_norm_path(adapter)}.weight"))
    with torch.inference_mode():
        hidden = [final(states.to(sweep.dtype)) for states in sweep.last_hidden]
    template = template_layer(adapter)
    for depth, layer in enumerate(layers, start=1):
        feed = feeds[layer]
        prefix = adapter.layer_prefix(layer)
        layer_keys = sweep.layer_keys.get(layer, [])
        extra_keys = [k for k in layer_keys if k[len(prefix) :].startswith(MTP_EXTRAS)]
        wanted = {feed.embed, feed.norm_embedding, feed.norm_hidden, feed.projection, feed.output_norm} - {None}
        extras = sweep.reader.read(sorted(set(extra_keys) | wanted))
        embed = extras[feed.embed]
        norm_embedding, norm_hidden = _norm(sweep, extras[feed.norm_embedding]), _norm(sweep, extras[feed.norm_hidden])
        projection = extras[feed.projection].to(sweep.dtype)
        module, moe, rest, layout = _materialise_mtp(
            sweep, layer, [k for k in layer_keys if k not in extra_keys], template
        )
        inputs, keep = [], []
        with torch.inference_mode():
            for batch, states in zip(batches, hidden, strict=True):
                ids = batch["input_ids"]
                following = torch.zeros(*ids.shape, embed.shape[1], dtype=sweep.dtype, device="cpu")
                following[:, :-depth] = F.embedding(ids[:, depth:], embed).to(sweep.dtype)
                joined = torch.cat([norm_embedding(following), norm_hidden(states.to(sweep.dtype))], dim=-1)
                inputs.append(F.linear(joined, projection))
                mask = torch.zeros(ids.shape, dtype=torch.bool, device="cpu")
                mask[:, :-depth] = True
                keep.append(mask.reshape(-1))
        captured: list[torch.Tensor] = []
        received: list[torch.Tensor] = []
        block = module.get_submodule(adapter.moe_block_name)
        handles = [
            block.register_forward_hook(lambda m, a, o, into=captured: into.append(a[0].reshape(-1, a[0].shape[-1])))
        ]
        if sweep.capture_attention:
            handles.append(
                module.self_attn.register_forward_hook(
                    lambda m, a, o, into=received: into.append(_attention_received(o[1]))
                )
            )
        outputs = sweep.forward_layer(module, template, inputs)
        for handle in handles:
            handle.remove()
        mask = torch.cat(keep)
        kept_rest = {k: v for k, v in extras.items() if k in extra_keys}
        yield LayerCapture(
            layer=layer,
            moe=moe,
            moe_input=(moe_input := torch.cat(captured).float())[mask.to(moe_input.device)],
            tags=sweep.tags[mask],
            tag_names=sweep.tag_names,
            attention_received=torch.cat(received).cpu()[mask] if received else None,
            rest={**rest, **kept_rest} if sweep.keep_tensors else None,
            layout=layout if sweep.keep_tensors else None,
        )
        sweep.release(module)
        if feed.output_norm is not None:
            output_norm = _norm(sweep, extras[feed.output_norm])
            with torch.inference_mode():
                outputs = [output_norm(out) for out in outputs]
        hidden = outputs


def with_mtp_captures(sweep: CalibrationSweep, captures, batches: list[dict[str, torch.Tensor]], mode: str):
    """``captures`` (the sweep's ``run``) followed, with ``mode`` keep, by the MTP layers' captures: the order in
    which a writer meets the layers (the MTP layers come after the main ones)."""
    yield from captures
    if mode == "keep":
        yield from mtp_captures(sweep, batches)


def template_layer(adapter: FamilyAdapter) -> int:
    """The main layer an MTP layer is built and called like: the last MoE layer with softmax attention (MTP
    layers are full-attention MoE layers, also in the hybrid Qwen3-Next and Qwen3.5)."""
    return max(layer for layer in adapter.moe_layers() if adapter.softmax_attention(layer))


def _materialise_mtp(sweep: CalibrationSweep, layer: int, keys: list[str], template: int):
    """The MTP layer's decoder layer as the stock module (built like main layer ``template``, a MoE layer of the
    same shape), its weights loaded, its MoE view, its other tensors and their layout."""
    adapter = sweep.adapter
    moe, rest, layout = adapter.split_layer(layer, sweep.reader.pending(keys), consume=True)
    state = adapter.runtime_layer_state(layer, moe, rest)
    state = {k: v.to(sweep.dtype) if v.is_floating_point() else v for k, v in state.items()}
    stock = adapter.decoder_layers(sweep._meta_model)[template]
    with torch.device("meta"):
        module = type(stock)(template_config(sweep), template)
    module.load_state_dict(state, strict=True, assign=True)
    for attribute in ("attention_type",):
        if hasattr(stock, attribute):
            setattr(module, attribute, getattr(stock, attribute))
    return sweep.placed(module).eval(), moe, rest, layout


def template_config(sweep: CalibrationSweep):
    config = sweep._config
    return getattr(config, "text_config", None) or config
