"""Qwen3-VL-MoE: the MoE text tower lives under ``model.language_model``; its experts are fused.

Hub checkpoints store ``gate_up_proj`` as ``[E, H, 2I]`` (gate half first) and ``down_proj`` as ``[E, I, H]``, the
transpose of the transformers 5 runtime layout (layout ``fused_transposed``); transformers 5's own
``save_pretrained`` writes the runtime orientation (layout ``fused``). The orientation is read off the shapes
and written back as found. The vision tower (``model.visual``) is passed through untouched.
"""

from __future__ import annotations

from .base import FamilyAdapter, Layout
from .qwen_moe import _QwenStyleAdapter
from .transposed_experts import TransposedFusedExperts
from .vision_language import TextTowerBesideVision


class Qwen3VLMoeAdapter(TextTowerBesideVision, TransposedFusedExperts, _QwenStyleAdapter):
    family = "qwen3_vl_moe"
    model_types = ("qwen3_vl_moe",)
    accepts_images = True

    def vision_token_ids(self) -> dict[str, int]:
        """The placeholder ids a calibration sequence needs around an image, and the vision merge size."""
        return {
            "image_token_id": int(self.config["image_token_id"]),
            "vision_start_id": int(self.config["vision_start_token_id"]),
            "vision_end_id": int(self.config["vision_end_token_id"]),
            "merge_size": int(self.config.get("vision_config", {}).get("spatial_merge_size", 2)),
        }

    def detect_layout(self, layer: int, keys) -> Layout:
        if self._fused_key(layer, "gate_up_proj") not in keys:
            return FamilyAdapter.detect_layout(self, layer, keys)
        if not isinstance(keys, dict):
            raise TypeError("fused Qwen3-VL-MoE layouts are told apart by shape; pass the tensors")
        hidden = int(self.text_config["hidden_size"])
        inter = int(self.text_config["moe_intermediate_size"])
        down_shape = tuple(keys[self._fused_key(layer, "down_proj")].shape[1:])
        gate_up_shape = tuple(keys[self._fused_key(layer, "gate_up_proj")].shape[1:])
        if (hidden != inter and down_shape == (inter, hidden)) or (
            hidden != 2 * inter and gate_up_shape == (hidden, 2 * inter)
        ):
            return "fused_transposed"
        return "fused"
