"""Mistral Large 4 (``mistral_large4``): Mistral Small 4's MoE block (softmax router, top-k renormalised and scaled by
``routed_scaling_factor``, one shared expert, the first ``first_k_dense_replace`` layers dense) under MLA attention
with a sparse-attention indexer, beside a Pixtral vision tower.

Its release keeps Mistral's native names, which transformers renames at load (``conversion_mapping.py``'s
``mistral_large4`` and ``mistral_large4_text`` rules) and writes back on ``save_pretrained``: ``tok_embeddings``,
``norm``, ``output``, ``lerope.alpha`` at the top, ``layers.{i}.attention.{wq,wkv_a_with_mqa,kv_a_norm,wkv_b,wo}``,
``attention.indexer.*``, ``ssmax_scaling.{s,b}``, ``attention_norm``/``ffn_norm``, dense ``feed_forward.w1/w2/w3``, and
in MoE layers ``gate.weight``, per-expert ``experts.{e}.w1/w3/w2`` (gate, up, down) and ``shared_experts.w1/w2/w3``.

Decoder layers hand state to later layers (carried by the layer sweep, :mod:`moecompress.sweep.layer_carry`): each
hands its indexer's top-k to the next (:mod:`.indexer_topk`); a ``kv_source_layers`` source writes its latent KV into
the forward's ``shared_kv_states`` and the layers that name it read it from there.
"""

from __future__ import annotations

from .indexer_topk import CarriedIndexerTopK
from .mistral4 import Mistral4Adapter
from .native_names import NativeNames, compile_renames
from .vision_language import LanguageModelAtRuntime

_VISION_PREFIXES = ("vision_encoder.", "patch_merger.", "pre_mm_projector_norm.", "vision_language_adapter.")
_OUTSIDE = (
    ("tok_embeddings.", "model.language_model.embed_tokens."),
    ("norm.", "model.language_model.norm."),
    ("output.", "lm_head."),
    ("lerope.alpha", "model.language_model.rotary_emb.alpha"),
)
_LOCAL = compile_renames(
    (r"^attention\.wq\.", "self_attn.q_proj."),
    (r"^attention\.wkv_a_with_mqa\.", "self_attn.kv_a_proj_with_mqa."),
    (r"^attention\.kv_a_norm\.", "self_attn.kv_a_layernorm."),
    (r"^attention\.wkv_b\.", "self_attn.kv_b_proj."),
    (r"^attention\.wo\.", "self_attn.o_proj."),
    (r"^attention\.", "self_attn."),
    (r"ssmax_scaling\.s$", "softmax_scaling.scale"),
    (r"ssmax_scaling\.b$", "softmax_scaling.bias"),
    (r"^attention_norm\.", "input_layernorm."),
    (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^(feed_forward|shared_experts)\.w1(\.|$)", r"\1.gate_proj\2"),
    (r"^(feed_forward|shared_experts)\.w2(\.|$)", r"\1.down_proj\2"),
    (r"^(feed_forward|shared_experts)\.w3(\.|$)", r"\1.up_proj\2"),
    (r"^feed_forward\.", "mlp."),
    (r"^(gate|experts|shared_experts)(\.|$)", r"mlp.\1\2"),
)
_STORED = compile_renames(
    (r"^self_attn\.q_proj\.", "attention.wq."),
    (r"^self_attn\.kv_a_proj_with_mqa\.", "attention.wkv_a_with_mqa."),
    (r"^self_attn\.kv_a_layernorm\.", "attention.kv_a_norm."),
    (r"^self_attn\.kv_b_proj\.", "attention.wkv_b."),
    (r"^self_attn\.o_proj\.", "attention.wo."),
    (r"^self_attn\.", "attention."),
    (r"softmax_scaling\.scale$", "ssmax_scaling.s"),
    (r"softmax_scaling\.bias$", "ssmax_scaling.b"),
    (r"^input_layernorm\.", "attention_norm."),
    (r"^post_attention_layernorm\.", "ffn_norm."),
    (r"^mlp\.(gate|experts|shared_experts)(\.|$)", r"\1\2"),
    (r"^mlp\.", "feed_forward."),
    (r"^(feed_forward|shared_experts)\.gate_proj(\.|$)", r"\1.w1\2"),
    (r"^(feed_forward|shared_experts)\.down_proj(\.|$)", r"\1.w2\2"),
    (r"^(feed_forward|shared_experts)\.up_proj(\.|$)", r"\1.w3\2"),
)
"""The inverse of ``_LOCAL``: what a quantised output stores, so that transformers' renaming at load applies once."""


class MistralLarge4Adapter(LanguageModelAtRuntime, NativeNames, CarriedIndexerTopK, Mistral4Adapter):
    family = "mistral_large4"
    model_types = ("mistral_large4",)
    layers_prefix = "layers."
    moe_disk_prefix = ""
    expert_names = ("w1", "w3", "w2")
    shared_state_keyword = "shared_kv_states"
    local_renames = _LOCAL
    stored_renames = _STORED
    outside_prefixes = _OUTSIDE

    def is_vision_key(self, key: str) -> bool:
        return key.startswith(_VISION_PREFIXES)

    def shared_state_sources(self, layer: int) -> list[int]:
        sources = self.text_config.get("kv_source_layers")
        return [int(sources[layer])] if sources and int(sources[layer]) != layer else []

    def classify_key(self, key: str) -> str:
        layer = self.layer_of_key(key)
        if layer is not None and not self.is_vision_key(key):
            prefix = self.layer_prefix(layer)
            local = key[len(prefix) :]
            if not local.startswith(("experts.", "gate.")):
                key = prefix + self.runtime_local_name(local)
        return super().classify_key(key)
