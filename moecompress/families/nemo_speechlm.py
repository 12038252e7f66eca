"""NVIDIA Nemotron 3.5 Transcribe (``nemo_speechlm``): a Nemotron-H text model (``text_config``,
:class:`NemotronHAdapter`) under ``llm.`` beside the speech towers (``perception.*``: the speech recognition encoder,
the diarization model and their projector; ``ctc_timestamp.*``: the word timestamp encoder and head), which are
passed through untouched. Text-only calibration runs the language model alone, as the stock forward does without
``input_features``.

On disk ``llm.model.layers.{i}.mixer.*``, ``llm.model.embed_tokens``, ``llm.model.norm``, ``llm.lm_head``; at
runtime ``model.language_model.{layers,embeddings,norm_f}`` and ``lm_head``. The experts are per expert
(``mixer.experts.{e}.{up,down}_proj.weight``, what ``save_pretrained`` writes) or, in NVIDIA's NeMo export, fused
and transposed: ``mixer.experts.gate_and_up_projs`` ``[E, H, I]`` (non-gated despite the name: the up projection) and
``down_projs`` ``[E, I, H]``, with the Mamba-2 ``A_log``/``D``/``dt_bias`` under ``mixer._fp32_params.``.
"""

from __future__ import annotations

import re

from .base import Layout
from .nemotron_h import NemotronHAdapter
from .transposed_experts import TransposedFusedExperts
from .vision_language import RenamedTextTower

_FP32 = re.compile(r"^mixer\._fp32_params\.(A_log|D|dt_bias)$")


class NemoSpeechLMAdapter(TransposedFusedExperts, RenamedTextTower, NemotronHAdapter):
    family = "nemo_speechlm"
    model_types = ("nemo_speechlm",)
    auto_class = "AutoModelForMultimodalLM"
    layers_prefix = "llm.model.layers."
    runtime_prefixes = (
        ("llm.model.layers.", "model.language_model.layers."),
        ("llm.model.embed_tokens.", "model.language_model.embeddings."),
        ("llm.model.norm.", "model.language_model.norm_f."),
        ("llm.lm_head.", "lm_head."),
    )
    vision_prefixes = ("perception.", "ctc_timestamp.")
    embeddings_prefix = "llm.model.embed_tokens."
    transposed_expert_names = ("gate_and_up_projs", "down_projs")

    def runtime_module_name(self, name: str) -> str:
        layer = self.layer_of_key(name)
        if layer is not None:
            return f"{self.runtime_layers_path}.{layer}.{self.runtime_local_key(layer, name)}"
        return super().runtime_module_name(name)

    def runtime_local_name(self, local_key: str) -> str:
        return _FP32.sub(r"mixer.\1", local_key)

    # ---- the NeMo export's fused, transposed experts ----------------------------------------------------------
    def detect_layout(self, layer: int, keys) -> Layout:
        if self._fused_key(layer, self.transposed_expert_names[0]) in keys:
            return "fused_transposed"
        return super().detect_layout(layer, keys)
