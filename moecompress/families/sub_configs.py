"""Model types that are only a part of another model's config (a ``text_config``, a vision encoder): transformers
has no class with a language-model head for them, so no checkpoint of their own is compressed; the wrapper's is."""

from __future__ import annotations


def _has_lm_head(model_type: str) -> bool:
    from transformers.models.auto import modeling_auto as auto

    return any(
        model_type in mapping
        for mapping in (
            auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
            auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES,
        )
    )


def sub_config_reason(model_type: str) -> str | None:
    """Why ``model_type`` is refused as a part of a wrapper's config, or None where it is a model of its own (or
    transformers does not know it)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    if model_type not in CONFIG_MAPPING_NAMES or _has_lm_head(model_type):
        return None
    module = model_type_to_module_name(model_type)
    wrappers = [
        other
        for other in CONFIG_MAPPING_NAMES
        if other != model_type and model_type_to_module_name(other) == module and _has_lm_head(other)
    ]
    if not wrappers:
        return None
    return (
        f"{model_type} is a sub-config of {' / '.join(wrappers)} with no model class of its own that has a "
        f"language-model head, so no checkpoint is saved under it: compress the {wrappers[0]} checkpoint"
    )
