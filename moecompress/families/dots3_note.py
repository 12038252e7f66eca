"""dots.llm3 Note's text model (``dots3_note_text``): DeepSeek-V3's MoE block (sigmoid scores plus a correction bias
for the choice, group-limited, renormalised, scaled; per-expert experts on disk; shared experts) in a decoder of MLA
layers with a DSA indexer and sliding-window MLA layers of their own sizes (``per_layer_config``), MoE where
``mlp_layer_types`` says ``sparse``; and its omni release (``dots3_note``)."""

from __future__ import annotations

from .deepseek import DeepseekV3Adapter
from .text_under_model import TextUnderModel


class Dots3NoteTextAdapter(DeepseekV3Adapter):
    family = "dots3_note_text"
    model_types = ("dots3_note_text",)
    first_dense_default = 1


class Dots3NoteAdapter(TextUnderModel, Dots3NoteTextAdapter):
    """The omni release (``dots3_note``, ``Dots3NoteForConditionalGeneration``): that text model under its own names
    beside ``vision_encoder.*`` (a vision tower with MoE layers of its own, passed through untouched like the rest of
    it) and ``audio_encoder.*``."""

    family = "dots3_note"
    model_types = ("dots3_note",)
    vision_prefixes = ("vision_encoder.", "audio_encoder.")
