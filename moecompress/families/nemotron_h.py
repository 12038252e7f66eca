"""Nemotron-H / Nemotron 3 (``nemotron_h``): a hybrid decoder whose blocks each hold one mixer, Mamba-2
(``linear_attention``), attention (``full_attention``), a dense MLP (``mlp``) or a MoE block (``moe``), as
``layers_block_type`` (the release's ``hybrid_override_pattern``: ``M``, ``*``, ``-``, ``E``) says.

The MoE block routes as DeepSeek-V3 does (sigmoid, ``e_score_correction_bias``, groups, renormalised, scaled by
``routed_scaling_factor`` inside the router) and its experts are not gated: ``down(act(up(x)))`` with
``mlp_hidden_act`` (the releases' squared ReLU). A shared expert of the same kind (``mixer.shared_experts``) runs
beside them, left untouched by expert passes. With ``moe_latent_size`` (Nemotron 3 Super) the block maps its input
to that width (``mixer.fc1_latent_proj``) before the experts and their sum back (``mixer.fc2_latent_proj``), while
router and shared expert read the block's input: the experts compute in the latent space
(:attr:`~moecompress.families.base.FamilyAdapter.latent_experts`).

On disk (the release's names and what ``save_pretrained`` writes): ``backbone.embeddings``, ``backbone.norm_f``,
``backbone.layers.{i}.norm`` and ``backbone.layers.{i}.mixer.*`` with per-expert
``mixer.experts.{e}.{up,down}_proj.weight``; transformers renames ``backbone.`` to ``model.`` and fuses the experts
to ``mixer.experts.{up,down}_proj`` at load.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..errors import UserInputError
from .deepseek import DeepseekV3Adapter

_PATTERN_KINDS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


class NemotronHAdapter(DeepseekV3Adapter):
    family = "nemotron_h"
    model_types = ("nemotron_h",)
    layers_prefix = "backbone.layers."
    moe_disk_prefix = "mixer."
    router_module = "mixer.gate"
    attention_module = "mixer"
    gated_experts = False
    latent_size_key = "moe_latent_size"
    embeddings_prefix: ClassVar[str] = "backbone.embeddings."
    """The stored token embeddings' prefix (footprints count them as embeddings; the release's name holds no
    ``embed_tokens``)."""

    @property
    def block_types(self) -> list[str]:
        cfg = self.text_config
        kinds = cfg.get("layers_block_type") or cfg.get("layer_types")
        if not kinds and cfg.get("hybrid_override_pattern"):
            kinds = [_PATTERN_KINDS[char] for char in cfg["hybrid_override_pattern"]]
        if not kinds:
            raise UserInputError("nemotron_h config has neither layers_block_type nor hybrid_override_pattern")
        return list(kinds)

    @property
    def num_layers(self) -> int:
        return len(self.block_types)

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and self.block_types[layer] == "moe"

    def softmax_attention(self, layer: int) -> bool:
        return self.block_types[layer] == "full_attention"

    def head_counts(self) -> tuple[int, int, int]:
        return super(DeepseekV3Adapter, self).head_counts()

    def activation(self, gate: torch.Tensor | None, up: torch.Tensor) -> torch.Tensor:
        from transformers.activations import ACT2FN

        return ACT2FN[self.text_config.get("mlp_hidden_act", "relu2")](up)

    def classify_key(self, key: str):
        if key.startswith(self.embeddings_prefix):
            return "embeddings"
        return super().classify_key(key)

    @property
    def runtime_layers_path(self) -> str:
        return "model.layers"

    def runtime_module_name(self, name: str) -> str:
        return "model." + name[len("backbone.") :] if name.startswith("backbone.") else name

    def runtime_outside_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {self.runtime_module_name(key): value for key, value in state.items()}
