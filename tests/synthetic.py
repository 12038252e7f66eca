"""Tiny random checkpoints of every supported family, for tests and benchmarks.

Each is built with the family's stock transformers class, its weights re-drawn from a seeded normal so routing
is far from uniform, and saved with ``save_pretrained`` (which writes the original on-disk layout).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch


def _without(config: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``config`` less ``keys``: a shared block of settings of which a family sets some otherwise or not at all."""
    return {key: value for key, value in config.items() if key not in keys}


_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=384,
    max_position_embeddings=128,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_TEXT = _without(_COMMON, "tie_word_embeddings")
"""``_COMMON`` in the text config of a multimodal release, which sets ``tie_word_embeddings`` at its top level."""

_MLA = dict(
    num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8
)
_MLA_NO_Q_LORA = dict(_MLA, q_lora_rank=None)
_DEEPSEEK_LAYERS = dict(
    num_hidden_layers=3,
    intermediate_size=64,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    first_k_dense_replace=1,
)
"""DeepSeek-style layers: a dense first layer (MLP 64 wide), then 8 routed experts 32 wide and a shared one."""
_DEEPSEEK_MOE = dict(_DEEPSEEK_LAYERS, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)
_INDEXER = dict(index_topk=32, index_head_dim=16, index_n_heads=2)
"""A sparse-attention indexer (DeepSeek-V3.2's lightning indexer and its kin): 2 heads 16 wide, 32 keys kept."""
_QWEN_STYLE_MOE = dict(num_hidden_layers=3, head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=8)
"""Three layers, heads 16 wide, dense MLPs 64 wide, 8 experts 32 wide (named as Qwen's MoE configs name them)."""
_SLIDING_FULL_SLIDING = dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=8)
_GATED_DELTANET = dict(
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16
)
"""The linear-attention (Gated DeltaNet) heads of Qwen3-Next's hybrid layers."""
_QWEN_HYBRID = dict(
    num_hidden_layers=3,
    head_dim=16,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_experts=8,
    norm_topk_prob=True,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    **_GATED_DELTANET,
)
_GRANITE = dict(
    _COMMON,
    num_hidden_layers=2,
    intermediate_size=32,
    num_local_experts=4,
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    logits_scaling=4.0,
    attention_multiplier=0.125,
)
_MROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
_MROPE_INTERLEAVED = dict(_MROPE, mrope_interleaved=True)
_TOWER: dict[str, Any] = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
"""The sizes of a tiny encoder beside the text model (a vision, audio or speech tower): one layer, 32 wide, 2 heads."""
_VISION: dict[str, Any] = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
"""A Qwen-VL-style vision tower (``depth``, ``num_heads``) merging 2x2 patches into the text model's width."""
_PIXTRAL = dict(_TOWER, model_type="pixtral", head_dim=16, image_size=32, patch_size=4)


def _vision_language(model_type: str, text: dict[str, Any], vision: dict[str, Any], **tokens: Any) -> dict[str, Any]:
    """The config of a vision-language release: tiny vision tower, image/video tokens at the top of the vocabulary."""
    return dict(
        model_type=model_type,
        text_config=text,
        vision_config=dict(_VISION, **vision),
        image_token_id=380,
        video_token_id=381,
        **tokens,
        tie_word_embeddings=False,
    )


def _qwen_vision_language(model_type: str, text: dict[str, Any], **vision: Any) -> dict[str, Any]:
    """A Qwen-VL release's config: :func:`_vision_language` with 16 position embeddings in the vision tower and vision
    start/end tokens."""
    return _vision_language(
        model_type,
        text,
        dict(num_position_embeddings=16, **vision),
        vision_start_token_id=382,
        vision_end_token_id=383,
    )


TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(_COMMON, model_type="mixtral", num_hidden_layers=2, intermediate_size=32, num_local_experts=4),
    "qwen2_moe": dict(
        _COMMON,
        model_type="qwen2_moe",
        num_hidden_layers=3,
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=6,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        _COMMON,
        model_type="qwen3_moe",
        num_hidden_layers=2,
        intermediate_size=64,
        head_dim=8,
        moe_intermediate_size=32,
        num_experts=8,
        norm_topk_prob=True,
    ),
    "olmoe": dict(
        _COMMON, model_type="olmoe", num_hidden_layers=2, intermediate_size=32, num_experts=8, num_key_value_heads=4
    ),
    "deepseek_v2": dict(
        _COMMON,
        **_DEEPSEEK_LAYERS,
        **_MLA_NO_Q_LORA,
        model_type="deepseek_v2",
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    ),
    "deepseek_v3": dict(_COMMON, **_DEEPSEEK_MOE, **_MLA, model_type="deepseek_v3"),
    "gpt_oss": dict(
        _COMMON,
        model_type="gpt_oss",
        num_hidden_layers=2,
        intermediate_size=32,
        head_dim=8,
        num_local_experts=4,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "qwen3_vl_moe": _qwen_vision_language(
        "qwen3_vl_moe",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=384,
            max_position_embeddings=128,
            num_hidden_layers=2,
            intermediate_size=64,
            moe_intermediate_size=96,
            num_experts=4,
            num_experts_per_tok=2,
            rope_parameters=_MROPE_INTERLEAVED,
        ),
        deepstack_visual_indexes=[0],
    ),
}

TINY_CONFIGS.update(
    {
        "glm4_moe": dict(
            _COMMON, **_DEEPSEEK_MOE, model_type="glm4_moe", head_dim=16, attention_bias=True, use_qk_norm=True
        ),
        "glm4_moe_lite": dict(
            _COMMON, **_DEEPSEEK_MOE, **_MLA, model_type="glm4_moe_lite", mlp_layer_types=["dense", "sparse", "sparse"]
        ),
        "deepseek_v32": dict(_COMMON, **_DEEPSEEK_MOE, **_MLA, **_INDEXER, model_type="deepseek_v32"),
        "dots1": dict(_COMMON, **_DEEPSEEK_MOE, model_type="dots1", head_dim=16),
        "kimi_k2": dict(
            TINY_CONFIGS["deepseek_v3"], model_type="deepseek_v3", n_group=1, topk_group=1, routed_scaling_factor=2.827
        ),
        "qwen3_next": dict(_COMMON, **_QWEN_HYBRID, model_type="qwen3_next", intermediate_size=64),
        "ernie4_5_moe": dict(
            _COMMON,
            model_type="ernie4_5_moe",
            num_hidden_layers=3,
            intermediate_size=64,
            moe_intermediate_size=32,
            moe_num_experts=8,
            moe_k=2,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_end_index=2,
            moe_layer_interval=1,
        ),
        "minimax": dict(
            _COMMON,
            model_type="minimax",
            num_hidden_layers=3,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            block_size=8,
        ),
        "minimax_m2": dict(
            _COMMON,
            model_type="minimax_m2",
            num_hidden_layers=2,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=8,
        ),
        "phimoe": dict(
            _COMMON,
            model_type="phimoe",
            num_hidden_layers=2,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=8,
            router_jitter_noise=0.5,
            attention_bias=True,
        ),
        "flex_olmo": dict(_COMMON, model_type="flex_olmo", num_hidden_layers=2, intermediate_size=32, num_experts=8),
        "solar_open": dict(_COMMON, **_DEEPSEEK_MOE, model_type="solar_open", head_dim=16),
        "exaone_moe": dict(
            _COMMON,
            **_without(_DEEPSEEK_MOE, "n_routed_experts", "n_shared_experts"),
            **_SLIDING_FULL_SLIDING,
            model_type="exaone_moe",
            head_dim=16,
            num_experts=8,
            num_shared_experts=1,
        ),
        "afmoe": dict(
            _COMMON,
            **_QWEN_STYLE_MOE,
            model_type="afmoe",
            num_shared_experts=1,
            num_dense_layers=1,
            route_scale=2.0,
        ),
        "lfm2_moe": dict(
            _COMMON,
            model_type="lfm2_moe",
            num_hidden_layers=3,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=8,
            num_dense_layers=1,
            layer_types=["conv", "full_attention", "conv"],
            routed_scaling_factor=1.5,
        ),
        "glm4v_moe": _vision_language(
            "glm4v_moe",
            dict(
                _TEXT,
                **_without(_DEEPSEEK_MOE, "num_hidden_layers"),
                num_hidden_layers=2,
                head_dim=16,
                rope_parameters=dict(_MROPE, partial_rotary_factor=0.5),
            ),
            dict(image_size=32),
            image_start_token_id=382,
            image_end_token_id=383,
        ),
        "hunyuan_v1_moe": dict(
            _COMMON,
            model_type="hunyuan_v1_moe",
            num_hidden_layers=2,
            head_dim=16,
            intermediate_size=32,
            num_experts=8,
            moe_topk=2,
            use_qk_norm=True,
        ),
        "granitemoe": dict(_GRANITE, model_type="granitemoe"),
        "qwen3_5_moe_text": dict(_COMMON, **_QWEN_HYBRID, model_type="qwen3_5_moe_text"),
        "qwen3_5_moe": _qwen_vision_language(
            "qwen3_5_moe",
            dict(_TEXT, **_QWEN_HYBRID, rope_parameters=dict(_MROPE_INTERLEAVED, partial_rotary_factor=0.5)),
        ),
        "llama4": dict(
            model_type="llama4",
            text_config=dict(
                _TEXT,
                num_hidden_layers=4,
                head_dim=16,
                intermediate_size=96,
                intermediate_size_mlp=128,
                num_local_experts=8,
                interleave_moe_layer_step=2,
                no_rope_layer_interval=2,
                attention_chunk_size=16,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
            vision_config=dict(
                _TOWER,
                vision_output_dim=32,
                image_size=32,
                patch_size=8,
                projector_input_dim=32,
                projector_output_dim=64,
            ),
            image_token_index=380,
            boi_token_index=381,
            eoi_token_index=382,
            tie_word_embeddings=False,
        ),
    }
)
TINY_CONFIGS["llama4_text"] = dict(TINY_CONFIGS["llama4"]["text_config"], model_type="llama4_text")

TINY_CONFIGS.update(
    {
        "glm_moe_dsa": dict(
            _COMMON,
            **_DEEPSEEK_MOE,
            **_MLA,
            **_INDEXER,
            model_type="glm_moe_dsa",
            index_topk_freq=2,
            index_skip_topk_offset=1,
        ),
        "minicpm5_moe": dict(_COMMON, **_DEEPSEEK_MOE, model_type="minicpm5_moe", head_dim=16),
        "granitemoeshared": dict(_GRANITE, model_type="granitemoeshared", shared_intermediate_size=48),
        "granitemoehybrid": dict(
            _GRANITE,
            model_type="granitemoehybrid",
            shared_intermediate_size=48,
            layer_types=["mamba", "attention"],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=16,
        ),
        "granitemoe_swa": dict(_GRANITE, model_type="granitemoe_swa", shared_intermediate_size=48, sliding_window=8),
        "kimi_k25": dict(
            model_type="kimi_k25",
            text_config=dict(TINY_CONFIGS["kimi_k2"], tie_word_embeddings=False),
            vision_config=dict(_TOWER, patch_size=4, pos_emb_height=8, pos_emb_width=8),
            projection_hidden_size=32,
            image_token_id=380,
            video_token_id=381,
            vision_start_token_id=382,
            vision_end_token_id=383,
            tie_word_embeddings=False,
        ),
        "sarvam_mla": dict(_COMMON, **_DEEPSEEK_MOE, **_MLA_NO_Q_LORA, model_type="sarvam_mla"),
        "sarvam_moe": dict(_COMMON, **_DEEPSEEK_MOE, model_type="sarvam_moe", head_dim=16),
        "param2moe": dict(_COMMON, **_DEEPSEEK_MOE, model_type="param2moe", head_dim=16, use_qk_norm=False),
        "kimi_linear": dict(
            _COMMON,
            **_without(_DEEPSEEK_MOE, "n_routed_experts", "n_shared_experts"),
            **_MLA_NO_Q_LORA,
            model_type="kimi_linear",
            num_local_experts=8,
            linear_head_dim=16,
            linear_num_heads=4,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
        ),
        "mimo_v2_flash": dict(
            _COMMON,
            **_without(_DEEPSEEK_MOE, "n_shared_experts", "first_k_dense_replace"),
            model_type="mimo_v2_flash",
            head_dim=16,
            v_head_dim=8,
            sliding_window=8,
        ),
        "mellum": dict(
            _COMMON,
            **_QWEN_STYLE_MOE,
            **_SLIDING_FULL_SLIDING,
            model_type="mellum",
            mlp_layer_types=["dense", "sparse", "sparse"],
        ),
        "hy_v3": dict(_COMMON, **_QWEN_STYLE_MOE, model_type="hy_v3", num_shared_experts=1, router_scaling_factor=2.5),
        "beam": dict(
            _COMMON,
            **_without(_DEEPSEEK_MOE, "n_routed_experts", "n_shared_experts"),
            **_SLIDING_FULL_SLIDING,
            model_type="beam",
            head_dim=16,
            num_experts=8,
            mlp_layer_types=["dense", "sparse", "sparse"],
        ),
        "laguna": dict(
            _COMMON,
            **_QWEN_STYLE_MOE,
            **_SLIDING_FULL_SLIDING,
            model_type="laguna",
            shared_expert_intermediate_size=32,
            moe_router_logit_softcapping=2.0,
            moe_routed_scaling_factor=1.5,
        ),
        "axk1": dict(_COMMON, **_DEEPSEEK_MOE, **_MLA, model_type="axk1"),
        "kolibri1": dict(
            _COMMON,
            model_type="kolibri1",
            num_hidden_layers=2,
            head_dim=16,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=8,
            norm_topk_prob=True,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
        ),
        "flint": dict(
            _COMMON,
            **_QWEN_STYLE_MOE,
            **_SLIDING_FULL_SLIDING,
            model_type="flint",
            shared_expert_intermediate_size=32,
            mlp_only_layers=[0],
        ),
        "cohere2_moe": dict(
            _COMMON,
            model_type="cohere2_moe",
            num_hidden_layers=3,
            head_dim=16,
            intermediate_size=32,
            num_experts=8,
            num_shared_experts=1,
            first_k_dense_replace=1,
            prefix_dense_intermediate_size=64,
            sliding_window=8,
            sliding_window_pattern=2,
            expert_selection_fn="sigmoid",
        ),
    }
)

_MISTRAL4 = dict(
    _TEXT,
    **_without(_DEEPSEEK_MOE, "num_hidden_layers", "n_group", "topk_group"),
    **_MLA,
    model_type="mistral4",
    num_hidden_layers=2,
)
TINY_CONFIGS.update(
    {
        "mistral4": dict(_MISTRAL4, tie_word_embeddings=False),
        "mistral3": dict(
            model_type="mistral3",
            text_config=_MISTRAL4,
            vision_config=_PIXTRAL,
            image_token_index=380,
            tie_word_embeddings=False,
        ),
    }
)

_MINIMAX_M3 = dict(
    _TEXT,
    model_type="minimax_m3_vl_text",
    num_hidden_layers=2,
    head_dim=16,
    rotary_dim=8,
    intermediate_size=32,
    dense_intermediate_size=64,
    shared_intermediate_size=32,
    num_local_experts=8,
    mlp_layer_types=["dense", "sparse"],
    layer_types=["full_attention", "minimax_m3_sparse"],
    index_n_heads=2,
    index_head_dim=16,
    index_block_size=8,
    index_topk_blocks=2,
)
TINY_CONFIGS.update(
    {
        "minimax_m3_vl_text": dict(_MINIMAX_M3, tie_word_embeddings=False),
        "minimax_m3_vl": dict(
            model_type="minimax_m3_vl",
            text_config=_MINIMAX_M3,
            vision_config=dict(_TOWER, image_size=32, patch_size=4),
            image_token_index=380,
            video_token_index=381,
            projector_hidden_size=64,
            merged_hidden_size=128,
            tie_word_embeddings=False,
        ),
    }
)
TINY_CONFIGS["deepseek_v4"] = dict(
    _COMMON,
    model_type="deepseek_v4",
    num_hidden_layers=3,
    num_key_value_heads=1,
    head_dim=16,
    partial_rotary_factor=0.5,
    q_lora_rank=32,
    moe_intermediate_size=32,
    n_routed_experts=8,
    mlp_layer_types=["hash_moe", "moe", "moe"],
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    hc_mult=2,
    sliding_window=16,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=4,
)
TINY_CONFIGS["hy_v4"] = dict(
    _COMMON,
    **_MLA,
    **_without(_DEEPSEEK_MOE, "first_k_dense_replace"),
    **_INDEXER,
    model_type="hy_v4",
    hc_mult=2,
)
TINY_CONFIGS["hy_v4_vl"] = dict(
    model_type="hy_v4_vl",
    text_config=dict(_without(TINY_CONFIGS["hy_v4"], "model_type"), rope_parameters=_MROPE),
    vision_config=dict(_TOWER, out_hidden_size=64, patch_size=16, max_image_size=64),
    image_token_id=380,
    video_token_id=381,
)
TINY_CONFIGS["kolibri1_1"] = dict(
    TINY_CONFIGS["kolibri1"],
    model_type="kolibri1_1",
    num_hidden_layers=4,
    layer_types=["sliding_attention", "indexed_attention", "sliding_attention", "indexed_attention"],
    index_layers=[1],
    kv_source_layers=[0, 1, 2, 1],
    mlp_only_layers=[0],
    mlp_only_intermediate_size=64,
    index_topk=4,
    index_pool_size=8,
    index_compression=4,
    index_num_heads=2,
    index_num_local_tokens=4,
    index_num_sink_tokens=2,
)
TINY_CONFIGS["longcat_flash"] = dict(
    _COMMON,
    **_MLA,
    model_type="longcat_flash",
    num_layers=2,
    head_dim=8,
    ffn_hidden_size=64,
    expert_ffn_hidden_size=32,
    n_routed_experts=8,
    zero_expert_num=4,
    routed_scaling_factor=2.0,
)
_GEMMA4 = dict(
    _COMMON,
    num_hidden_layers=2,
    head_dim=16,
    global_head_dim=16,
    intermediate_size=48,
    hidden_size_per_layer_input=0,
    sliding_window=16,
    layer_types=["sliding_attention", "full_attention"],
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
)
TINY_CONFIGS["gemma4_text"] = dict(_GEMMA4, model_type="gemma4_text")
TINY_CONFIGS["gemma4"] = dict(
    model_type="gemma4",
    text_config=_GEMMA4,
    vision_config=dict(_TOWER, num_key_value_heads=2, head_dim=16, patch_size=4),
    image_token_id=380,
    video_token_id=381,
    boi_token_id=382,
    eoi_token_id=383,
    audio_token_id=379,
    boa_token_id=378,
    eoa_token_index=377,
    tie_word_embeddings=True,
)
TINY_CONFIGS["nemotron_h"] = dict(
    _COMMON,
    model_type="nemotron_h",
    layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "moe"],
    head_dim=16,
    intermediate_size=64,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    n_routed_experts=8,
    mamba_num_heads=8,
    mamba_head_dim=8,
    ssm_state_size=16,
    n_groups=2,
    chunk_size=16,
    routed_scaling_factor=2.5,
)

_QWEN4_EXP = dict(
    _QWEN_HYBRID,
    hc_count=2,
    hc_lowrank=8,
    ple_layer_ids=[1],
    ple_embed_dim=32,
    ngram_size=2,
    heads_per_ngram=2,
    ngram_vocab_size_base=50,
    make_ngram_vocab_size_divisible_by=8,
    split_ngram_parts=2,
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=16,
    indexer_budget=32,
    indexer_compress_ratio=4,
)
TINY_CONFIGS["qwen4_exp_text"] = dict(_COMMON, **_QWEN4_EXP, model_type="qwen4_exp_text")
TINY_CONFIGS["qwen4_exp"] = _qwen_vision_language(
    "qwen4_exp", dict(_TEXT, **_QWEN4_EXP, rope_parameters=dict(_MROPE_INTERLEAVED, partial_rotary_factor=0.5))
)
TINY_CONFIGS["mistral_large4"] = dict(
    model_type="mistral_large4",
    text_config=dict(
        _TEXT,
        **_without(_MLA, "q_lora_rank"),
        **_without(_DEEPSEEK_MOE, "n_group", "topk_group", "num_hidden_layers"),
        **_INDEXER,
        model_type="mistral_large4_text",
        num_hidden_layers=4,
        indexer_types=["full", "shared", "full", "shared"],
        kv_source_layers=[0, 0, 2, 2],
        no_rope_layers=[1, 1, 0, 0],
    ),
    vision_config=_PIXTRAL,
    image_token_index=380,
    tie_word_embeddings=False,
)

TINY_CONFIGS["jamba"] = dict(
    _COMMON,
    model_type="jamba",
    num_hidden_layers=4,
    intermediate_size=32,
    num_experts=4,
    attn_layer_period=2,
    attn_layer_offset=1,
    expert_layer_period=2,
    expert_layer_offset=0,
    mamba_d_state=8,
    mamba_dt_rank=8,
)

_ARIA_TEXT = dict(
    _without(_TEXT, "num_experts_per_tok"),
    model_type="aria_text",
    num_hidden_layers=2,
    intermediate_size=32,
    moe_num_experts=4,
    moe_topk=2,
    moe_num_shared_experts=2,
)
TINY_CONFIGS["aria_text"] = dict(_ARIA_TEXT, tie_word_embeddings=False)
TINY_CONFIGS["aria"] = dict(
    model_type="aria",
    text_config=_ARIA_TEXT,
    vision_config=dict(_TOWER, patch_size=4),
    projector_patch_to_query_dict={"1225": 8, "4900": 8},
    image_token_id=380,
    tie_word_embeddings=False,
)

TINY_CONFIGS["lara_mini"] = dict(
    _COMMON,
    **_without(_QWEN_HYBRID, "norm_topk_prob", "layer_types"),
    model_type="lara_mini",
    layer_types=["linear_attention", "sliding_attention", "full_attention"],
    sliding_window=8,
)
TINY_CONFIGS["axk2"] = dict(
    _COMMON,
    **_without(_DEEPSEEK_MOE, "n_group", "topk_group"),
    **_MLA,
    **_INDEXER,
    model_type="axk2",
    gated_norm_rank=8,
)
TINY_CONFIGS["nemotron_h_omni"] = dict(
    model_type="nemotron_h_omni",
    text_config=_without(TINY_CONFIGS["nemotron_h"], "tie_word_embeddings"),
    vision_config=dict(_TOWER, patch_size=4, video_temporal_patch_size=2),
    vision_hidden_size=32,
    projector_hidden_size=32,
    image_token_id=380,
    tie_word_embeddings=False,
)
TINY_CONFIGS["dots3_note_text"] = dict(
    _COMMON,
    **_DEEPSEEK_MOE,
    **_MLA,
    **_INDEXER,
    model_type="dots3_note_text",
    head_dim=16,
    shared_experts_intermediate_size=32,
    sliding_window=8,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=4,
    swa_q_lora_rank=32,
    swa_kv_lora_rank=32,
    swa_head_dim=16,
    swa_qk_nope_head_dim=8,
    swa_v_head_dim=8,
)
TINY_CONFIGS["dots3_note"] = dict(
    model_type="dots3_note",
    text_config=_without(TINY_CONFIGS["dots3_note_text"], "model_type", "tie_word_embeddings"),
    vision_config=dict(
        _TOWER,
        patch_size=4,
        moe_intermediate_size=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        pyramid_num_routed=[4],
        adapter_in_dim=32,
        adapter_out_dim=64,
    ),
    audio_config=dict(_TOWER, downsample_hidden_size=16, adapter_input_size=32, adapter_out_dim=64, feature_size=16),
    image_token_id=380,
    video_token_id=381,
    audio_token_id=382,
    tie_word_embeddings=False,
)
_OCR_TEXT = dict(
    _TEXT,
    **_without(_DEEPSEEK_LAYERS, "first_k_dense_replace"),
    num_key_value_heads=4,
    mlp_layer_types=["dense", "sparse", "sparse"],
    topk_method="group_limited_greedy",
    n_group=2,
    topk_group=1,
    routed_scaling_factor=1.5,
)
_OCR_VISION = dict(
    sam_config=dict(
        hidden_size=32,
        output_channels=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=64,
        patch_size=16,
        window_size=2,
        global_attn_indexes=[0],
        mlp_dim=32,
        downsample_channels=[32, 64],
    ),
    encoder_config=dict(
        vocab_size=384, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    ),
)
TINY_CONFIGS["deepseek_ocr2"] = dict(
    model_type="deepseek_ocr2",
    text_config=_OCR_TEXT,
    vision_config=_OCR_VISION,
    image_token_id=380,
    tie_word_embeddings=False,
)
TINY_CONFIGS["unlimited_ocr"] = dict(
    model_type="unlimited_ocr",
    text_config=dict(_OCR_TEXT, sliding_window=8),
    vision_config=dict(_OCR_VISION, encoder_config=dict(_OCR_VISION["encoder_config"], image_size=64, patch_size=16)),
    image_token_id=380,
    tie_word_embeddings=False,
)
TINY_CONFIGS["glm5_next"] = dict(
    model_type="glm5_next",
    text_config=dict(
        _TEXT,
        **_without(_DEEPSEEK_MOE, "first_k_dense_replace", "num_hidden_layers"),
        **dict(_MLA, qk_rope_head_dim=0, qk_nope_head_dim=16),
        **_INDEXER,
        num_hidden_layers=4,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"],
        index_kpool=4,
        linear_head_dim=16,
        linear_num_heads=4,
        hc_mult=2,
        swiglu_limit=0.15,
    ),
    vision_config=dict(
        _without(_VISION, "spatial_merge_size", "temporal_patch_size"),
        patch_size=14,
        image_size=28,
        projection_intermediate_size=32,
    ),
    image_token_id=380,
    video_token_id=381,
    image_start_token_id=376,
    image_end_token_id=377,
    video_start_token_id=378,
    video_end_token_id=379,
)
TINY_CONFIGS["ergo"] = dict(
    _TEXT,
    model_type="ergo",
    num_hidden_layers=3,
    head_dim=16,
    first_dense_intermediate_size=64,
    num_dense_blocks=1,
    moe_intermediate_size=32,
    shared_intermediate_size=32,
    num_experts=8,
    sliding_window=8,
    global_attention_every_n_layers=2,
)
_QWEN3_OMNI_TEXT = dict(
    _TEXT,
    num_hidden_layers=2,
    head_dim=16,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_experts=8,
    rope_parameters=_MROPE_INTERLEAVED,
)
TINY_CONFIGS["qwen3_omni_moe_thinker"] = dict(
    model_type="qwen3_omni_moe_thinker",
    text_config=_QWEN3_OMNI_TEXT,
    audio_config=dict(
        num_mel_bins=16,
        encoder_layers=1,
        encoder_attention_heads=2,
        encoder_ffn_dim=32,
        d_model=32,
        output_dim=64,
        downsample_hidden_size=16,
        max_source_positions=64,
    ),
    vision_config=dict(_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0]),
    image_token_id=380,
    video_token_id=381,
    audio_token_id=382,
    tie_word_embeddings=False,
)

TINY_CONFIGS["qwen3_omni_moe"] = dict(
    model_type="qwen3_omni_moe",
    thinker_config=_without(TINY_CONFIGS["qwen3_omni_moe_thinker"], "model_type"),
    talker_config=dict(
        text_config=dict(_QWEN3_OMNI_TEXT, vocab_size=96, shared_expert_intermediate_size=32),
        code_predictor_config=dict(
            _TOWER,
            intermediate_size=64,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=64,
            num_code_groups=4,
        ),
        thinker_hidden_size=64,
        accept_hidden_layer=1,
        spatial_merge_size=2,
    ),
    code2wav_config=dict(
        _TOWER,
        intermediate_size=64,
        num_key_value_heads=1,
        codebook_size=64,
        num_quantizers=4,
        decoder_dim=32,
        upsample_rates=[2, 2],
        upsampling_ratios=[2, 2],
    ),
)
"""Qwen3-Omni's release: the thinker above, a talker with MoE layers (passed through) and a code2wav vocoder."""

TINY_CONFIGS["muse_spark"] = dict(
    model_type="muse_spark",
    text_config=dict(
        _TEXT,
        num_hidden_layers=3,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=64,
        num_local_experts=8,
        moe_hidden_size=32,
        mlp_layer_types=["dense", "sparse", "sparse"],
        routed_scaling_factor=2.0,
    ),
    vision_config=dict(_TOWER, intermediate_size=64, pos_emb_height=4, pos_emb_width=4),
    audio_config=dict(hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], out_hidden_size=64),
    out_hidden_size=64,
    projector_hidden_size=32,
    image_token_id=380,
    video_token_id=381,
    audio_token_id=382,
    tie_word_embeddings=False,
)

TINY_CONFIGS["dbrx"] = dict(
    model_type="dbrx",
    d_model=64,
    n_heads=4,
    n_layers=2,
    max_seq_len=128,
    vocab_size=384,
    attn_config=dict(kv_n_heads=2, clip_qkv=8.0, rope_theta=10000.0),
    ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2, moe_jitter_eps=0.01),
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

_INKLING_ATTENTION = dict(
    head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, d_rel=8, rel_extent=32
)
"""Inkling's hybrid attention: full and sliding-window heads 16 wide, relative-position features 8 wide."""
_INKLING_TEXT = dict(
    _COMMON,
    **_INKLING_ATTENTION,
    num_hidden_layers=3,
    sliding_window_size=16,
    layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
    mlp_layer_types=["dense", "sparse", "sparse"],
    intermediate_size=64,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=2,
    route_scale=2.0,
)
TINY_CONFIGS["inkling_text"] = dict(_INKLING_TEXT, model_type="inkling_text")
TINY_CONFIGS["zaya"] = dict(
    _COMMON,
    model_type="zaya",
    num_hidden_layers=3,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=1,
    router_hidden_size=16,
    layer_types=["hybrid", "hybrid_sliding", "hybrid"],
    sliding_window=8,
)
TINY_CONFIGS["inkling_mm_model"] = dict(
    model_type="inkling_mm_model",
    text_config=_INKLING_TEXT,
    audio_config=dict(n_mel_bins=4, mel_vocab_size=8),
    vision_config=dict(patch_size=4, hidden_size=32, num_hidden_layers=4, num_attention_heads=2),
    image_token_id=380,
    audio_token_id=381,
    image_bos_token_id=378,
    audio_bos_token_id=379,
    tie_word_embeddings=False,
)
_INKLING2_TEXT = dict(
    _COMMON,
    **_INKLING_ATTENTION,
    num_hidden_layers=4,
    sliding_window_size=8,
    layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
    n_layers_per_attn_res_block=2,
    moe_intermediate_size=32,
    n_routed_experts=8,
    route_scale=2.0,
    mlp_gate_softcap=1.0,
    mlp_up_softcap=2.0,
    unpadded_vocab_size=384,
)
TINY_CONFIGS["inkling2_text"] = dict(_INKLING2_TEXT, model_type="inkling2_text")
TINY_CONFIGS["inkling2"] = dict(
    model_type="inkling2",
    text_config=_INKLING2_TEXT,
    vision_config=dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        patch_size=4,
        posemb_grid_size=4,
        projection_hidden_dim=32,
        text_hidden_size=64,
    ),
    image_token_id=380,
    tie_word_embeddings=False,
)
_INKLING2_LOOP_TEXT = dict(
    _INKLING2_TEXT,
    num_hidden_layers=7,
    layer_types=["hybrid_sliding", "hybrid"] * 3 + ["hybrid_sliding"],
    loop_layer_index_start=2,
    loop_layer_index_end=6,
    loop_num_passes=3,
    loop_gate_rank=8,
)
"""Two layers before the looped segment, four looped (two block boundaries inside: the messages read one), one
after; three passes (so a pass reads messages of a pass that read messages)."""
TINY_CONFIGS["inkling2_loop_text"] = dict(_INKLING2_LOOP_TEXT, model_type="inkling2_loop_text")
TINY_CONFIGS["inkling2_loop"] = dict(
    TINY_CONFIGS["inkling2"], model_type="inkling2_loop", text_config=dict(_INKLING2_LOOP_TEXT)
)
_NEMO_AUDIO = dict(_TOWER, num_mel_bins=16)
TINY_CONFIGS["nemo_speechlm"] = dict(
    model_type="nemo_speechlm",
    text_config=_without(TINY_CONFIGS["nemotron_h"], "tie_word_embeddings"),
    audio_config=dict(
        asr_config=_NEMO_AUDIO,
        diarization_config=dict(
            model_type="nemotron3_diarization",
            audio_config=_NEMO_AUDIO,
            head_config=dict(hidden_size=16, num_speakers=4, audio_hidden_size=32),
            streaming_config=dict(num_speakers=4, speaker_cache_length=8, fifo_length=8, speaker_cache_update_period=8),
            chunk_length=16,
            chunk_right_context=2,
            chunk_left_context=2,
            fifo_length=8,
            speaker_cache_update_period=8,
        ),
    ),
    word_timestamp_config=dict(_TOWER, vocab_size=16, blank_token_id=15),
    audio_token_id=383,
    tie_word_embeddings=False,
)
TINY_CONFIGS["step3p7"] = dict(
    model_type="step3p7",
    text_config=dict(
        _COMMON,
        num_hidden_layers=3,
        intermediate_size=64,
        moe_intermediate_size=32,
        n_routed_experts=8,
        share_expert_dim=32,
        head_dim=16,
        mlp_layer_types=["dense", "sparse", "sparse"],
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
        swiglu_limits=[0, 0, 1.0],
        swiglu_limits_shared=[0, 0.5, 0],
    ),
    vision_config=dict(_TOWER, image_size=28),
    image_token_id=380,
    tie_word_embeddings=False,
)
TINY_CONFIGS["bailing_hybrid"] = dict(
    _COMMON,
    **_without(_DEEPSEEK_MOE, "n_routed_experts", "n_shared_experts"),
    **_MLA_NO_Q_LORA,
    model_type="bailing_hybrid",
    num_local_experts=8,
    head_dim=16,
    layer_types=["linear_attention", "linear_attention", "full_attention"],
    expert_swiglu_limit_list=[0, 1.0, 0],
    share_expert_swiglu_limit_list=[0, 0, 0.5],
)

TINY_CONFIGS["jetmoe"] = dict(
    _without(_COMMON, "max_position_embeddings"),
    model_type="jetmoe",
    num_hidden_layers=2,
    kv_channels=16,
    intermediate_size=32,
    num_local_experts=8,
    max_position_embeddings=128,
)

TINY_CONFIGS["ernie4_5_vl_moe"] = _vision_language(
    "ernie4_5_vl_moe",
    dict(
        _TEXT,
        num_hidden_layers=3,
        intermediate_size=64,
        moe_intermediate_size=[64, 32],
        moe_num_experts=4,
        moe_k=2,
        moe_num_shared_experts=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]},
    ),
    {},
    image_start_token_id=382,
    image_end_token_id=383,
    video_start_token_id=378,
    video_end_token_id=379,
)
TINY_CONFIGS["switch_transformers"] = dict(
    model_type="switch_transformers",
    vocab_size=512,
    d_model=64,
    d_kv=16,
    d_ff=64,
    num_heads=4,
    num_layers=2,
    num_decoder_layers=2,
    num_sparse_encoder_layers=1,
    num_sparse_decoder_layers=2,
    num_experts=8,
    expert_capacity=12,
    router_jitter_noise=0.0,
    dropout_rate=0.0,
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=2,
)
"""An encoder-decoder: a dense and a sparse encoder block, two sparse decoder blocks, 8 experts that each take at
most 12 tokens of a sequence (so calibration windows overflow some), a vocabulary with room for T5's sentinels
(:func:`tiny_tokenizer_for`)."""

FAMILIES: tuple[str, ...] = tuple(TINY_CONFIGS)

TINY_VARIANTS: dict[str, dict[str, Any]] = {
    "nemotron_h_latent": dict(TINY_CONFIGS["nemotron_h"], moe_latent_size=32, moe_intermediate_size=96),
}
"""Tiny models of a family's variant that the family-parametrised tests do not repeat, built by name as
``TINY_CONFIGS`` entries are (Nemotron 3 Super's experts in a latent space, 32 wide beside ``hidden_size`` 64)."""

_RELEASE_CONFIG: dict[str, dict[str, Any]] = {
    "mimo_v2_flash": {"routed_scaling_factor": None},
    "kimi_k2": {
        "model_type": "kimi_k2",
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
    },
}
"""``config.json`` entries of a hub release that ``save_pretrained`` of the stock class does not write."""
_FUSED_RELEASES = ("qwen3_5_moe", "qwen4_exp")
_QWEN_MTP_RELEASES = ("qwen3_next", "qwen3_5_moe")
"""Families whose hub releases carry a top-level ``mtp.*`` multi-token-prediction module (which transformers skips)."""
"""Families whose hub releases store the experts fused (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj``
``[E, H, I]``) where ``save_pretrained`` writes them per expert."""


def tiny_config(family: str):
    """The transformers config object of ``family``'s tiny model."""
    from transformers import AutoConfig

    kwargs = dict(TINY_CONFIGS[family] if family in TINY_CONFIGS else TINY_VARIANTS[family])
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(model_type, **kwargs)


_RELEASE_CLASS = {"qwen3_omni_moe": "AutoModelForMultimodalLM"}
"""Releases saved by another class than the sub-model moecompress builds (Qwen3-Omni's thinker)."""


def auto_class_for(config) -> Any:
    import transformers

    from moecompress.families import adapter_for

    return getattr(transformers, _RELEASE_CLASS.get(config.model_type) or adapter_for(config.to_dict()).auto_class)


def build_tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A randomly initialised tiny model of ``family`` in eval mode."""
    config = tiny_config(family)
    torch.manual_seed(seed)
    model = auto_class_for(config).from_config(config, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1 and "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias", "balancing_biases")):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
            elif name.endswith("tid2eid"):
                experts = int(config.num_local_experts)
                rows = [torch.randperm(experts, generator=generator)[: buffer.shape[1]] for _ in range(buffer.shape[0])]
                buffer.copy_(torch.stack(rows))
    return model.eval()


def save_tiny_model(family: str, directory: str | os.PathLike[str], seed: int = 0, **save_kwargs: Any) -> Path:
    """Build ``family``'s tiny model and save it to ``directory`` with ``save_pretrained``, then in its hub
    release's layout where that differs (config entries, fused experts)."""
    model = build_tiny_model(family, seed)
    model.save_pretrained(directory, **save_kwargs)
    directory = Path(directory)
    if family in _RELEASE_CONFIG:
        config = json.loads((directory / "config.json").read_text())
        config.update(_RELEASE_CONFIG[family])
        (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if family in _FUSED_RELEASES:
        _fuse_experts(directory)
    if family in _QWEN_MTP_RELEASES:
        _add_qwen_mtp(directory)
    if family == "kimi_k25":
        _kimi_k25_release_layout(directory)
    if family == "deepseek_v4":
        _deepseek_v4_release_layout(directory)
    return directory


def _add_qwen_mtp(directory: Path) -> None:
    """Add the release's top-level ``mtp.*`` module (Qwen3-Next, Qwen3.5): a full-attention MoE decoder layer (a copy
    of decoder layer 1) with its input projection and norms, and ``mtp_num_hidden_layers: 1``."""
    from safetensors.torch import load_file, save_file

    shard = directory / "model.safetensors"
    tensors = load_file(shard)
    config = json.loads((directory / "config.json").read_text())
    text = config.get("text_config", config)
    text["mtp_num_hidden_layers"] = 1
    source = next(
        prefix
        for prefix in ("model.language_model.layers.1.", "model.layers.1.")
        if prefix + "mlp.gate.weight" in tensors
    )
    hidden = int(text["hidden_size"])
    generator = torch.Generator().manual_seed(1)
    mtp = {
        "mtp.layers.0." + key[len(source) :]: value.clone() for key, value in tensors.items() if key.startswith(source)
    }
    mtp["mtp.fc.weight"] = 0.2 * torch.randn(hidden, 2 * hidden, generator=generator)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=generator)
    save_file({**tensors, **mtp}, str(shard), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _deepseek_v4_release_layout(directory: Path) -> None:
    """DeepSeek-V4's release names its tensors without ``model.`` (``layers.*``, ``embed.weight``, ``norm.weight``,
    ``hc_head_fn``...) and stores the hash table ``tid2eid`` as int32; ``save_pretrained`` keeps ``model.`` and
    transformers' names outside the layers."""
    from safetensors.torch import load_file, save_file

    outside = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    outside.update({f"model.hc_head.hc_{part}": f"hc_head_{part}" for part in ("fn", "base", "scale")})
    shard = directory / "model.safetensors"
    tensors = load_file(shard)
    renamed = {}
    for key, tensor in tensors.items():
        name = outside.get(key, key.removeprefix("model."))
        renamed[name] = tensor.to(torch.int32) if name.endswith("tid2eid") else tensor
    save_file(renamed, str(shard), metadata={"format": "pt"})


def _kimi_k25_release_layout(directory: Path) -> None:
    """Kimi-K2.5's release names its decoder layers ``language_model.model.layers`` and its text config
    ``model_type: kimi_k2``; transformers' reversed load rules make ``save_pretrained`` write
    ``language_model.model.blocks`` (the vision tower's ``blocks`` -> ``layers`` rule, undone on every key)."""
    from safetensors.torch import load_file, save_file

    shard = directory / "model.safetensors"
    tensors = load_file(shard)
    old, new = "language_model.model.blocks.", "language_model.model.layers."
    renamed = {key.replace(old, new): tensor for key, tensor in tensors.items()}
    save_file(renamed, str(shard), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["text_config"]["model_type"] = "kimi_k2"
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _fuse_experts(directory: Path) -> None:
    """Rewrite every shard's per-expert ``experts.{e}.{gate,up,down}_proj.weight`` as fused tensors."""
    import re

    from safetensors.torch import load_file, save_file

    pattern = re.compile(r"(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for shard in sorted(directory.glob("*.safetensors")):
        tensors = load_file(shard)
        groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
        for key in list(tensors):
            if match := pattern.match(key):
                prefix, expert, name = match.group(1), int(match.group(2)), match.group(3)
                groups.setdefault(prefix, {}).setdefault(name, {})[expert] = tensors.pop(key)
        for prefix, parts in groups.items():
            count = len(parts["gate_proj"])
            gate = torch.stack([parts["gate_proj"][e] for e in range(count)])
            up = torch.stack([parts["up_proj"][e] for e in range(count)])
            tensors[prefix + "gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
            tensors[prefix + "down_proj"] = torch.stack([parts["down_proj"][e] for e in range(count)]).contiguous()
        save_file(tensors, str(shard), metadata={"format": "pt"})
        if index is not None:
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not pattern.match(k)}
            index["weight_map"].update({key: shard.name for key in tensors})
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2) + "\n")


def tiny_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer with the tiny models' 384-token vocabulary, trained on built-in prose."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from moecompress.calibration.builtin_corpus import builtin_documents

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator((doc.text for doc in builtin_documents("prose", "calib")[:10]), trainer=trainer)
    assert tokenizer.get_vocab_size() == vocab_size
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


SENTINELS = 100
"""T5's sentinel count (``<extra_id_0>`` .. ``<extra_id_99>``), added to a seq2seq family's tiny tokenizer."""


def tiny_tokenizer_for(family: str):
    """:func:`tiny_tokenizer`, with T5's sentinels for a family whose calibration is span corruption."""
    tokenizer = tiny_tokenizer()
    if TINY_CONFIGS[family]["model_type"] == "switch_transformers":
        tokenizer.add_special_tokens({"additional_special_tokens": [f"<extra_id_{i}>" for i in range(SENTINELS)]})
    return tokenizer


def save_tiny_source(family: str, directory: str | os.PathLike[str], seed: int = 0) -> Path:
    """:func:`save_tiny_model` with :func:`tiny_tokenizer` saved beside it: a source that the commands can calibrate
    and evaluate."""
    directory = save_tiny_model(family, directory, seed)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def write_synthetic_qwen3_moe(
    directory: Path,
    layers: int,
    hidden: int,
    experts: int,
    inter: int,
    vocab_dir: Path | None = None,
    *,
    heads: int = 8,
    kv_heads: int = 4,
    head_dim: int | None = None,
    top_k: int = 2,
    max_shard_bytes: int = 512 * 2**20,
    vocab_size: int = 2048,
    tie_word_embeddings: bool = True,
) -> dict:
    """A random bf16 Qwen3-MoE checkpoint of any size, written layer by layer (never held whole), for
    benchmarks. ``vocab_dir``'s tokenizer files are copied in when given. Returns ``{"layer_bytes": ...}``.

    ``vocab_size`` above the tokenizer's (2,048 for tiny-moe's) gives the embedding and output projection a real
    release's size (Qwen3-30B-A3B: 151,936, untied) while the built-in text still tokenises: the extra rows are
    never looked up, but every logit is computed over all of them, as a padded release's are."""
    from transformers import Qwen3MoeConfig

    head_dim = head_dim or hidden // heads
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        moe_intermediate_size=inter,
        intermediate_size=4 * hidden,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=512,
    ).to_dict()
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    config["dtype"] = "bfloat16"
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=generator)).to(torch.bfloat16)

    from moecompress.checkpoint import CheckpointWriter

    writer = CheckpointWriter(directory, max_shard_bytes=max_shard_bytes)
    outside = {"model.embed_tokens.weight": rand(vocab_size, hidden), "model.norm.weight": torch.ones(hidden)}
    if not tie_word_embeddings:
        outside["lm_head.weight"] = rand(vocab_size, hidden)
    writer.add({name: tensor.to(torch.bfloat16) for name, tensor in outside.items()})
    del outside
    layer_bytes = 0
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors = {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
            p + "mlp.gate.weight": rand(experts, hidden, scale=0.5),
        }
        for e in range(experts):
            tensors[p + f"mlp.experts.{e}.gate_proj.weight"] = rand(inter, hidden)
            tensors[p + f"mlp.experts.{e}.up_proj.weight"] = rand(inter, hidden)
            tensors[p + f"mlp.experts.{e}.down_proj.weight"] = rand(hidden, inter)
        layer_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        writer.add(tensors)
        del tensors
    for name in ("tokenizer.json", "tokenizer_config.json") if vocab_dir is not None else ():
        shutil.copy(vocab_dir / name, writer.work_dir / name)
    writer.finish(config)
    return {"layer_bytes": layer_bytes}
