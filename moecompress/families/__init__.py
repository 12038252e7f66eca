"""Family adapters and the registry that picks one from a config."""

from __future__ import annotations

from typing import Any

from ..errors import UserInputError
from .aria import AriaAdapter, AriaTextAdapter
from .axk2 import AXK2Adapter
from .bailing_hybrid import BailingHybridAdapter
from .base import PARAM_CLASSES, FamilyAdapter, ModelShape, MoEWeights
from .cohere import Cohere2MoeAdapter
from .dbrx import DbrxAdapter
from .deepseek import DeepseekV2Adapter, DeepseekV3Adapter
from .deepseek_derived import (
    AXK1Adapter,
    BeamAdapter,
    DeepseekV32Adapter,
    Dots1Adapter,
    ExaoneMoeAdapter,
    Glm4MoeAdapter,
    Glm4MoeLiteAdapter,
    Glm4vMoeAdapter,
    GlmMoeDsaAdapter,
    KimiK2Adapter,
    MiMoV2FlashAdapter,
    MiniCPM5MoeAdapter,
    SarvamMlaAdapter,
    SolarOpenAdapter,
)
from .deepseek_ocr import DeepseekOcr2Adapter
from .deepseek_v4 import DeepseekV4Adapter
from .dots3_note import Dots3NoteAdapter, Dots3NoteTextAdapter
from .ergo import ErgoAdapter
from .ernie import Ernie45MoeAdapter
from .ernie_vl import Ernie45VLMoeAdapter
from .gemma4 import Gemma4Adapter, Gemma4TextAdapter
from .glm5_next import Glm5NextAdapter
from .gpt_oss import GptOssAdapter
from .granite import GraniteMoeAdapter, GraniteMoeHybridAdapter, GraniteMoeSharedAdapter, GraniteMoeSWAAdapter
from .hunyuan import HunyuanMoeAdapter, HYV3Adapter
from .hy_v4 import HYV4Adapter, HYV4VLAdapter
from .inkling import InklingAdapter, InklingTextAdapter
from .inkling2 import Inkling2Adapter, Inkling2TextAdapter
from .inkling2_loop import Inkling2LoopAdapter, Inkling2LoopTextAdapter
from .jamba import JambaAdapter
from .jetmoe import JetMoeAdapter
from .kimi_k25 import KimiK25Adapter
from .kimi_linear import KimiLinearAdapter
from .kolibri import Kolibri1Adapter
from .kolibri1_1 import Kolibri1_1Adapter
from .laguna import LagunaAdapter
from .lara_mini import LaraMiniAdapter
from .llama4 import Llama4Adapter, Llama4TextAdapter
from .longcat_flash import LongcatFlashAdapter
from .minimax import MiniMaxAdapter, MiniMaxM2Adapter
from .minimax_m3 import MiniMaxM3TextAdapter, MiniMaxM3VLAdapter
from .mistral4 import Mistral3Adapter, Mistral4Adapter
from .mistral_large4 import MistralLarge4Adapter
from .mixtral import MixtralAdapter, PhimoeAdapter
from .muse_spark import MuseSparkAdapter
from .nemo_speechlm import NemoSpeechLMAdapter
from .nemotron_h import NemotronHAdapter
from .nemotron_h_omni import NemotronHOmniAdapter
from .qwen3_omni import Qwen3OmniMoeAdapter
from .qwen3_omni_thinker import Qwen3OmniMoeThinkerAdapter
from .qwen3_vl_moe import Qwen3VLMoeAdapter
from .qwen4_exp import Qwen4ExpAdapter, Qwen4ExpTextAdapter
from .qwen_moe import (
    FlexOlmoAdapter,
    FlintAdapter,
    MellumAdapter,
    OlmoeAdapter,
    Qwen2MoeAdapter,
    Qwen3MoeAdapter,
)
from .qwen_next import Qwen3_5MoeAdapter, Qwen3_5MoeTextAdapter, Qwen3NextAdapter
from .routing import RoutingRule
from .sarvam import Param2MoeAdapter, SarvamMoeAdapter
from .sigmoid_bias import AfmoeAdapter, Lfm2MoeAdapter
from .step3p7 import Step3p7Adapter
from .sub_configs import sub_config_reason
from .switch_transformers import SwitchTransformersAdapter
from .unlimited_ocr import UnlimitedOcrAdapter
from .zaya import ZayaAdapter

ADAPTERS: tuple[type[FamilyAdapter], ...] = (
    MixtralAdapter,
    Qwen2MoeAdapter,
    Qwen3MoeAdapter,
    OlmoeAdapter,
    DeepseekV2Adapter,
    DeepseekV3Adapter,
    GptOssAdapter,
    Qwen3VLMoeAdapter,
    Glm4MoeAdapter,
    Glm4MoeLiteAdapter,
    KimiK2Adapter,
    DeepseekV32Adapter,
    Dots1Adapter,
    Qwen3NextAdapter,
    Qwen3_5MoeAdapter,
    Qwen3_5MoeTextAdapter,
    Ernie45MoeAdapter,
    MiniMaxAdapter,
    MiniMaxM2Adapter,
    HunyuanMoeAdapter,
    GraniteMoeAdapter,
    PhimoeAdapter,
    FlexOlmoAdapter,
    SolarOpenAdapter,
    ExaoneMoeAdapter,
    GlmMoeDsaAdapter,
    MiniCPM5MoeAdapter,
    KimiK25Adapter,
    SarvamMlaAdapter,
    MiMoV2FlashAdapter,
    MellumAdapter,
    HYV3Adapter,
    BeamAdapter,
    LagunaAdapter,
    AXK1Adapter,
    Kolibri1Adapter,
    FlintAdapter,
    KimiLinearAdapter,
    SarvamMoeAdapter,
    Param2MoeAdapter,
    GraniteMoeSharedAdapter,
    GraniteMoeHybridAdapter,
    GraniteMoeSWAAdapter,
    Cohere2MoeAdapter,
    AfmoeAdapter,
    Lfm2MoeAdapter,
    Glm4vMoeAdapter,
    Llama4Adapter,
    Llama4TextAdapter,
    Mistral4Adapter,
    Mistral3Adapter,
    MiniMaxM3TextAdapter,
    MiniMaxM3VLAdapter,
    NemotronHAdapter,
    Gemma4TextAdapter,
    Gemma4Adapter,
    LongcatFlashAdapter,
    DeepseekV4Adapter,
    HYV4Adapter,
    HYV4VLAdapter,
    Kolibri1_1Adapter,
    MistralLarge4Adapter,
    Qwen4ExpTextAdapter,
    Qwen4ExpAdapter,
    JambaAdapter,
    AriaTextAdapter,
    AriaAdapter,
    LaraMiniAdapter,
    AXK2Adapter,
    NemotronHOmniAdapter,
    NemoSpeechLMAdapter,
    Dots3NoteTextAdapter,
    Dots3NoteAdapter,
    DeepseekOcr2Adapter,
    UnlimitedOcrAdapter,
    Glm5NextAdapter,
    ErgoAdapter,
    Qwen3OmniMoeThinkerAdapter,
    Qwen3OmniMoeAdapter,
    MuseSparkAdapter,
    DbrxAdapter,
    JetMoeAdapter,
    Step3p7Adapter,
    BailingHybridAdapter,
    InklingTextAdapter,
    InklingAdapter,
    ZayaAdapter,
    Inkling2TextAdapter,
    Inkling2Adapter,
    Ernie45VLMoeAdapter,
    SwitchTransformersAdapter,
    Inkling2LoopTextAdapter,
    Inkling2LoopAdapter,
)
_BY_MODEL_TYPE = {model_type: cls for cls in ADAPTERS for model_type in cls.model_types}
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(cls.family for cls in ADAPTERS)


def families_declaring(hook: str) -> list[str]:
    """The families whose adapter class sets the class attribute ``hook`` itself (see ``FamilyAdapter._declared``),
    sorted."""
    return sorted(cls.family for cls in ADAPTERS if vars(cls).get(hook) is not None)


REFUSED_FAMILIES: dict[str, str] = {
    "mistral_large4_text": (
        "transformers has no language-model class for Mistral Large 4's text config (MistralLarge4TextModel has no "
        "output head); its release is mistral_large4, whose text model moecompress compresses"
    ),
    "nllb-moe": (
        "stock transformers' NllbMoeExperts runs expert_0 and expert_1 for every token whatever the router chose, so "
        "no output can be checked against the model as routed or run correctly by it"
    ),
    **dict.fromkeys(
        ("vitpose", "vitpose_backbone"),
        "ViTPose is a pose-estimation vision model: its 'experts' are per-dataset output rows of the backbone's MLP, "
        "picked by a dataset index, not routed per token",
    ),
    "openai_privacy_filter": (
        "OpenAI Privacy Filter is a bidirectional token classifier with no language-model head, so next-token "
        "calibration and evaluation do not apply"
    ),
    "doge": (
        "Doge's experts are single-neuron embedding rows (down_embed/up_embed) retrieved by product keys over "
        "sqrt(E) x sqrt(E) router halves, with no gate/up/down matrices per expert"
    ),
    "diffusion_gemma": (
        "DiffusionGemma is a block-diffusion model: its experts serve a causal encoder and a bidirectional denoising "
        "decoder that share their weights and read the encoder's cache, so next-token calibration and evaluation do "
        "not apply"
    ),
}
"""MoE families transformers has that moecompress refuses on purpose, with the reason it gives."""
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _declares_experts(config: dict[str, Any]) -> bool:
    sections = [config] + [v for v in config.values() if isinstance(v, dict)]
    return any(int(section.get(key) or 0) > 0 for section in sections for key in _EXPERT_COUNT_KEYS)


def adapter_for(config: dict[str, Any], source: str = "model") -> FamilyAdapter:
    """The adapter for a model's ``config.json`` contents; a :class:`UserInputError` if there is none."""
    model_type = config.get("model_type")
    supported = ", ".join(SUPPORTED_FAMILIES)
    cls = _BY_MODEL_TYPE.get(model_type)
    if cls is None:
        if model_type in REFUSED_FAMILIES:
            raise UserInputError(f"{source}: {model_type} is not supported: {REFUSED_FAMILIES[model_type]}")
        part_of = sub_config_reason(model_type) if _declares_experts(config) else None
        if part_of:
            raise UserInputError(f"{source}: {model_type} is not supported: {part_of}")
        if _declares_experts(config):
            raise UserInputError(f"{source}: unsupported MoE family {model_type!r}; supported families: {supported}")
        raise UserInputError(
            f"{source}: model_type {model_type!r} has no MoE layers; supported MoE families: {supported}"
        )
    adapter = cls(config)
    if not adapter.moe_layers():
        raise UserInputError(f"{source}: {model_type} model has no MoE layers (routed expert count is 0)")
    return adapter


__all__ = [
    "ADAPTERS",
    "PARAM_CLASSES",
    "REFUSED_FAMILIES",
    "SUPPORTED_FAMILIES",
    "FamilyAdapter",
    "MoEWeights",
    "ModelShape",
    "RoutingRule",
    "adapter_for",
    "families_declaring",
]
