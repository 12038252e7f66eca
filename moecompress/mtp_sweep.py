"""Calibration of a multi-token-prediction (MTP) layer: the MoE inputs it sees on the calibration data.

DeepSeek-V3's MTP module (also Kimi-K2's and GLM-4.5's) predicts token i+2 from the main model's last hidden state
h_i and the embedding of token i+1: ``x_i = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])``, then a full decoder
layer (its own attention and MoE block) on x. This is the order vLLM's ``deepseek_mtp`` uses. The last position of
each window has no next token; its input is computed with a zero embedding (so the causal attention of the other
positions is that of the full window) and left out of the capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .checkpoint.mtp import mtp_layers
from .sweep import CalibrationSweep, LayerCapture, _attention_received

MTP_EXTRAS = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def calibrates_mtp(sweep: CalibrationSweep, layer: int) -> bool:
    """Whether ``layer``'s stored tensors hold what the MTP module needs (enorm, hnorm, eh_proj)."""
    prefix = sweep.adapter.layer_prefix(layer)
    keys = set(sweep.reader.keys())
    return all(f"{prefix}{name}weight" in keys for name in ("enorm.", "hnorm.", "eh_proj."))


def mtp_captures(sweep: CalibrationSweep, batches: list[dict[str, torch.Tensor]]):
    """A :class:`LayerCapture` per MTP layer that :func:`calibrates_mtp`, after ``sweep.run`` has finished (it
    needs ``sweep.last_hidden``). Several MTP layers are chained as DeepSeek-V3 does: layer k+1 takes layer k's
    output as its hidden state and the embedding one token further on."""
    adapter = sweep.adapter
    layers = [layer for layer in mtp_layers(adapter, sweep.reader.keys()) if calibrates_mtp(sweep, layer)]
    hidden = list(sweep.last_hidden)
    eps = float(adapter.text_config.get("rms_norm_eps", 1e-6))
    last_main = adapter.num_layers - 1
    for depth, layer in enumerate(layers, start=1):
        prefix = adapter.layer_prefix(layer)
        keys = sweep.layer_keys.get(layer, [])
        extras = sweep.reader.read([k for k in keys if k[len(prefix) :].startswith(MTP_EXTRAS)])
        embed = extras.get(f"{prefix}embed_tokens.weight")
        if embed is None:
            embed = sweep.reader.tensor(next(k for k in sweep.reader.keys() if k.endswith("embed_tokens.weight")))
        module, moe = _materialise_mtp(sweep, layer, [k for k in keys if not k[len(prefix) :].startswith(MTP_EXTRAS)])
        inputs, keep = [], []
        for batch, states in zip(batches, hidden, strict=True):
            ids = batch["input_ids"]
            following = torch.zeros(*ids.shape, embed.shape[1], dtype=sweep.dtype, device="cpu")
            following[:, :-depth] = F.embedding(ids[:, depth:], embed).to(sweep.dtype)
            joined = torch.cat(
                [
                    _rms_norm(following, extras[f"{prefix}enorm.weight"], eps),
                    _rms_norm(states, extras[f"{prefix}hnorm.weight"], eps),
                ],
                dim=-1,
            )
            inputs.append(F.linear(joined.to(sweep.dtype), extras[f"{prefix}eh_proj.weight"].to(sweep.dtype)))
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
        outputs = sweep.forward_layer(module, last_main, inputs)
        for handle in handles:
            handle.remove()
        mask = torch.cat(keep)
        yield LayerCapture(
            layer=layer,
            moe=moe,
            moe_input=(moe_input := torch.cat(captured).float())[mask.to(moe_input.device)],
            tags=sweep.tags[mask],
            tag_names=sweep.tag_names,
            attention_received=torch.cat(received).cpu()[mask] if received else None,
        )
        sweep.release(module)
        hidden = outputs


def _materialise_mtp(sweep: CalibrationSweep, layer: int, keys: list[str]):
    """The MTP layer's decoder layer as the stock module (built like the last main layer, which is a MoE layer
    of the same shape), its weights loaded, and its MoE view."""
    adapter = sweep.adapter
    moe, rest, _ = adapter.split_layer(layer, sweep.reader.pending(keys), consume=True)
    state = adapter.runtime_layer_state(layer, moe, rest)
    state = {k: v.to(sweep.dtype) if v.is_floating_point() else v for k, v in state.items()}
    template = adapter.decoder_layers(sweep._meta_model)[adapter.num_layers - 1]
    with torch.device("meta"):
        module = type(template)(template_config(sweep), adapter.num_layers - 1)
    module.load_state_dict(state, strict=True, assign=True)
    for attribute in ("attention_type",):
        if hasattr(template, attribute):
            setattr(module, attribute, getattr(template, attribute))
    return sweep.placed(module).eval(), moe


def template_config(sweep: CalibrationSweep):
    config = sweep._config
    return getattr(config, "text_config", None) or config
