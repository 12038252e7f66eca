"""Sarvam-30B (``sarvam_moe``) and Param-2 (``param2moe``): GLM-4.5's MoE decoder (transformers builds
``Glm4MoeForCausalLM``) in the Ling/Bailing release names, which transformers renames at load:

- ``model.word_embeddings`` (``model.embed_tokens``);
- ``attention.query_key_value`` ``[(heads + 2 kv_heads) * head_dim, H]`` (split into ``self_attn.q/k/v_proj``),
  ``attention.dense`` (``self_attn.o_proj``), ``attention.query_layernorm`` / ``key_layernorm`` (``q_norm`` /
  ``k_norm``);
- ``mlp.gate.expert_bias`` (``mlp.gate.e_score_correction_bias``); experts per expert as DeepSeek-V3's.

The checkpoint is read and written in these names; the calibration sweep builds the stock layer from the runtime ones.
"""

from __future__ import annotations

import torch

from .bailing_names import BailingNames
from .block_bias import CorrectionBiasOffRouter
from .deepseek_derived import _GroupedQueryAttentionAdapter

_LOCAL_RENAMES = (
    ("attention.dense.", "self_attn.o_proj."),
    ("attention.query_layernorm.", "self_attn.q_norm."),
    ("attention.key_layernorm.", "self_attn.k_norm."),
    ("attention.", "self_attn."),
)


class SarvamMoeAdapter(BailingNames, CorrectionBiasOffRouter, _GroupedQueryAttentionAdapter):
    family = "sarvam_moe"
    model_types = ("sarvam_moe",)
    correction_bias_key = "mlp.gate.expert_bias"
    first_dense_default = 1
    fused_on_disk_targets = ("attention",)

    def runtime_local_name(self, local_key: str) -> str:
        for disk, runtime in _LOCAL_RENAMES:
            if local_key.startswith(disk):
                return runtime + local_key[len(disk) :]
        return local_key

    def runtime_local_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = dict(state)
        heads, kv_heads, head_dim = self.head_counts()
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        for kind in ("weight", "bias"):
            fused = state.pop(f"self_attn.query_key_value.{kind}", None)
            if fused is not None:
                for name, part in zip(("q_proj", "k_proj", "v_proj"), torch.split(fused, sizes, dim=0), strict=True):
                    state[f"self_attn.{name}.{kind}"] = part
        return state


class Param2MoeAdapter(SarvamMoeAdapter):
    """Param-2 (BharatGen): Sarvam-30B's layout and block."""

    family = "param2moe"
    model_types = ("param2moe",)
