"""Qwen4-Exp: Qwen3.5-MoE's MoE block (softmax top-k, renormalised, a sigmoid-gated shared expert) and hybrid
decoder (Gated DeltaNet and indexed full attention), with hyper-connections (``hc_count`` residual streams mixed
into the block's input and the block's output injected back) and per-layer n-gram embeddings (PLE) on the layers
``ple_layer_ids`` lists. Both sit outside the MoE block: its router and experts read the mixed ``hidden_size``-wide
input, so the expert view is Qwen3.5-MoE's. ``qwen4_exp`` is the vision-language wrapper (text tower under
``model.language_model``, experts fused), ``qwen4_exp_text`` the text model."""

from __future__ import annotations

import re

import torch

from .qwen_next import Qwen3_5MoeAdapter, Qwen3_5MoeTextAdapter

_NGRAM_SHARD = re.compile(r"^ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")


class ShardedNgramEmbedding:
    """Mixin: the PLE n-gram table is stored in ``split_ngram_parts`` row shards (``ngram_embedding.shard_{i}``),
    which transformers concatenates into ``ngram_embedding.weight`` at load."""

    reads_token_ids = True

    def runtime_local_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        shards = {int(m.group(1)): key for key in state if (m := _NGRAM_SHARD.match(key))}
        if not shards:
            return state
        out = {key: value for key, value in state.items() if not _NGRAM_SHARD.match(key)}
        out["ple.ple_embedding.ngram_embedding.weight"] = torch.cat([state[shards[i]] for i in sorted(shards)])
        return out


class Qwen4ExpTextAdapter(ShardedNgramEmbedding, Qwen3_5MoeTextAdapter):
    family = "qwen4_exp_text"
    model_types = ("qwen4_exp_text",)


class Qwen4ExpAdapter(ShardedNgramEmbedding, Qwen3_5MoeAdapter):
    family = "qwen4_exp"
    model_types = ("qwen4_exp",)
