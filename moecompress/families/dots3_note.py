"""dots.llm3 Note's text model (``dots3_note_text``): DeepSeek-V3's MoE block (sigmoid scores plus a correction bias
for the choice, group-limited, renormalised, scaled; per-expert experts on disk; shared experts) in a decoder of MLA
layers with a DSA indexer and sliding-window MLA layers of their own sizes (``per_layer_config``), MoE where
``mlp_layer_types`` says ``sparse``."""

from __future__ import annotations

from .deepseek import DeepseekV3Adapter


class Dots3NoteTextAdapter(DeepseekV3Adapter):
    family = "dots3_note_text"
    model_types = ("dots3_note_text",)
    first_dense_default = 1
