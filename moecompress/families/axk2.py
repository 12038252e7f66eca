"""A.X-K2 (``axk2``): DeepSeek-V3.2's decoder (MLA with a DSA indexer; sigmoid routing with a correction bias, groups
only where ``n_group`` is set; per-expert experts on disk; shared experts) whose layer norms are gated: the input norm
and, in MoE layers, the post-attention norm multiply the RMS-normalised input by a low-rank SiLU gate MLP, stored as
``W_down``/``W_up`` and renamed ``mlp.fc1``/``mlp.fc2`` by transformers at load. The release also fuses the query
up-projection with the attention output gate as ``self_attn.q_b_proj`` (``self_attn.q_gate_proj`` at runtime).
Both sit outside the MoE block, so only the stand-in layers' names differ from DeepSeek-V3's."""

from __future__ import annotations

from .deepseek import DeepseekV3Adapter

_RENAMES = (("W_down", "mlp.fc1"), ("W_up", "mlp.fc2"), ("self_attn.q_b_proj.", "self_attn.q_gate_proj."))


class AXK2Adapter(DeepseekV3Adapter):
    family = "axk2"
    model_types = ("axk2",)
    first_dense_default = 1

    def runtime_local_name(self, local_key: str) -> str:
        for disk, runtime in _RENAMES:
            local_key = local_key.replace(disk, runtime)
        return local_key
