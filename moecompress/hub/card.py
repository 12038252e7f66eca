"""The model card of a moecompress output, built only from what its ``moecompress_report.json`` recorded.

Every number on the card is read from a report; a number the report does not hold is left out, never estimated.
When an output was made from another moecompress output (prune, then quantise the pruned directory), the reports
are followed back through their ``source`` paths, so the recipe lists every pass and ``base_model`` names the
original model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..output_report import REPORT_NAME

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CACHE_SNAPSHOT = re.compile(r"(?:^|/)models--(?P<repo>[^/]+)/snapshots/[^/]+/?$")
_MAX_CHAIN = 16


def _entry(name: str) -> Any:
    """The registered pass a report names (None for a pass this version does not know)."""
    from ..passes.registry import PASSES

    return PASSES.get(name)


def _quantizes(name: str) -> bool:
    entry = _entry(name)
    return entry is not None and entry.quantizes


@dataclass(frozen=True)
class PassStep:
    """One pass of the recipe: its name and its configuration as the report recorded it."""

    name: str
    config: dict[str, Any]


@dataclass
class CardInfo:
    """The rendered card (README.md text) and what was decided while building it."""

    text: str
    base_model: str | None
    base_model_relation: str | None
    license: str | None
    steps: list[PassStep]
    warnings: list[str] = field(default_factory=list)


def load_report(directory: Path) -> dict[str, Any] | None:
    """The moecompress report in ``directory``, or None when there is none (or it is not a JSON object)."""
    path = Path(directory) / REPORT_NAME
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) and "pass" in report else None


def report_chain(report: dict[str, Any]) -> list[dict[str, Any]]:
    """``report`` preceded by the reports of the moecompress outputs it was made from, oldest first: a recipe's
    earlier passes (``previous_passes``), then the reports of the input's own sources."""
    chain = [*(report.get("previous_passes") or []), report]
    seen: set[str] = set()
    while len(chain) < _MAX_CHAIN:
        source = chain[0].get("source")
        if not source or source in seen:
            break
        seen.add(source)
        previous = load_report(Path(source))
        if previous is None:
            break
        chain.insert(0, previous)
    return chain


def steps_of(chain: Sequence[dict[str, Any]]) -> list[PassStep]:
    """The recipe's passes, one per report; a report with ``quantize_config`` (QAT's) keeps its quantisation
    settings beside its config, the recipe's nested ``quantize``."""
    steps = []
    for report in chain:
        config = dict(report.get("config") or {})
        if report.get("quantize_config") is not None:
            config["quantize"] = report["quantize_config"]
        steps.append(PassStep(report["pass"], config))
    return steps


def recipe_yaml(steps: Sequence[PassStep], model: str) -> str:
    """The passes as a YAML recipe: the model, then each pass with its configuration, in order."""
    document = {"model": model, "passes": [{step.name: step.config} for step in steps]}
    return yaml.safe_dump(document, sort_keys=False, allow_unicode=True)


def base_model_relation(steps: Sequence[PassStep]) -> str:
    """The Hub's ``base_model_relation`` for an output made by ``steps``.

    The Hub documents four values: ``adapter``, ``merge``, ``quantized`` and ``finetune``. Any quantising pass
    (quantize, QAT) makes the output a quantised copy of its base, so ``quantized``. Pruning experts or attention
    heads is none of the four exactly: the output is not an adapter (it is a full checkpoint), not a merge of
    several models, and not quantised; it is a full set of weights derived from one base model's, which is what
    the Hub's ``finetune`` stands for (its catch-all for derived full weights), so pruned outputs say ``finetune``.
    """
    return "quantized" if any(_quantizes(step.name) for step in steps) else "finetune"


def hub_id_of_source(source: str | None) -> str | None:
    """The Hub id a source directory came from, where one can be known.

    A Hugging Face cache snapshot (``.../models--ORG--NAME/snapshots/REV``) names its repo; otherwise a
    config.json ``_name_or_path`` that looks like a Hub id (and is not a local path) is used.
    """
    if not source:
        return None
    match = _CACHE_SNAPSHOT.search(Path(source).as_posix())
    if match:
        return match["repo"].replace("--", "/", 1)
    try:
        config = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("_name_or_path") if isinstance(config, dict) else None
    if isinstance(name, str) and _HUB_ID.match(name) and not Path(name).expanduser().exists():
        return name
    return None


def source_license(source: str | None) -> dict[str, str]:
    """``license`` (and ``license_name``/``license_link``) from the source directory's README front matter."""
    if not source:
        return {}
    from huggingface_hub.repocard import metadata_load

    try:
        metadata = metadata_load(Path(source) / "README.md") or {}
    except (OSError, ValueError, yaml.YAMLError):
        return {}
    return {key: str(metadata[key]) for key in ("license", "license_name", "license_link") if metadata.get(key)}


def human_bytes(value: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} B"


def build_card(
    directory: Path,
    report: dict[str, Any],
    *,
    repo_id: str | None = None,
    base_model: str | None = None,
    version: str | None = None,
) -> CardInfo:
    """The README.md for the moecompress output in ``directory`` whose report is ``report``.

    ``base_model`` overrides the Hub id resolved from the source; when none is known the field is left out
    and a warning is returned.
    """
    from huggingface_hub import ModelCard, ModelCardData

    if version is None:
        from .. import __version__ as version
    chain = report_chain(report)
    steps = steps_of(chain)
    root_source = chain[0].get("source")
    warnings = []
    base = base_model or hub_id_of_source(root_source)
    if base is None:
        warnings.append(
            f"no Hub id is known for the source model ({root_source}); base_model is left out of the card "
            "(set it with --base-model ORG/NAME)"
        )
    relation = base_model_relation(steps) if base else None
    licence = source_license(root_source)
    config = _read_json(Path(directory) / "config.json")
    architecture = (config.get("architectures") or [""])[0]
    data = ModelCardData(
        base_model=base,
        library_name="transformers",
        pipeline_tag=_pipeline_tag(architecture),
        tags=_tags(chain),
        **licence,
    )
    if relation:
        data.base_model_relation = relation
    name = repo_id or Path(directory).resolve().name
    body = [
        f"# {name.split('/')[-1]}",
        "",
        _summary(chain, base, root_source),
        "",
        *_measured(report),
        *_usage(chain, config, architecture, name, Path(directory)),
        "## Recipe",
        "",
        "The passes that produced this checkpoint and their settings, as recorded in `moecompress_report.json`:",
        "",
        "```yaml",
        recipe_yaml(steps, base or _source_label(root_source)).rstrip(),
        "```",
        "",
        f"Card written by moecompress {version}.",
        "",
    ]
    text = f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body)
    ModelCard(text)  # parses the front matter back: a card the Hub library cannot read is never written
    return CardInfo(text, base, relation, licence.get("license"), steps, warnings)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _source_label(source: str | None) -> str:
    """How the card names a source without a Hub id: ``builtin:NAME`` for a shipped model, else its folder name."""
    if not source:
        return "unknown"
    from ..checkpoint.resolve import BUILTIN_MODELS

    for name, path in BUILTIN_MODELS.items():
        if Path(source).resolve() == path.resolve():
            return f"builtin:{name}"
    return Path(source).name


def _pipeline_tag(architecture: str) -> str | None:
    if architecture.endswith("ForCausalLM"):
        return "text-generation"
    if architecture.endswith("ForConditionalGeneration"):
        return "image-text-to-text"
    return None


def _tags(chain: Sequence[dict[str, Any]]) -> list[str]:
    tags = ["moe", "moecompress"]
    for report in chain:
        entry = _entry(report["pass"])
        if entry is None:
            continue
        if entry.quantizes:
            scheme = (report.get("scheme") or {}).get("name") or (report.get("config") or {}).get("scheme")
            tags += ["quantized", *([str(scheme)] if scheme else [])]
            settings = report.get("quantize_config", report.get("config"))
            from ..quantization.formats import OUTPUT_FORMATS

            layout = OUTPUT_FORMATS.get((settings or {}).get("format"))
            if layout is not None and layout.card_tag:
                tags.append(layout.card_tag)
        tags += entry.card_tags
    return list(dict.fromkeys(tags))


# ---------------------------------------------------------------------------------------------------------------
# Summary


def _summary(chain: Sequence[dict[str, Any]], base: str | None, source: str | None) -> str:
    origin = f"[{base}](https://huggingface.co/{base})" if base else f"`{_source_label(source)}`"
    sentences = [_SUMMARIES.get(report["pass"], _summary_unknown)(report) for report in chain]
    return f"A compressed copy of {origin}, made with moecompress. " + " ".join(sentences)


def _quantize_sentence(report: dict[str, Any], config: dict[str, Any]) -> str:
    scheme = report.get("scheme_description") or config.get("scheme", "an unrecorded scheme")
    targets = config.get("targets") or []
    method = str(config.get("method", "")).upper()
    text = f"Quantised {', '.join(targets) or 'the selected weights'} to {scheme}" + (
        f" with {method}" if method else ""
    )
    footprint = report.get("footprint") or {}
    classes = footprint.get("classes") or {}
    parts = [f"{_bpw(classes[t]['bits_per_weight'])} bits/weight for {t}" for t in targets if t in classes]
    if "bits_per_weight" in (footprint.get("total") or {}):
        parts.append(f"{_bpw(footprint['total']['bits_per_weight'])} bits/weight for the whole model")
    source_bytes = (report.get("source_footprint") or {}).get("file_bytes")
    if source_bytes and footprint.get("file_bytes"):
        parts.append(f"{human_bytes(source_bytes)} -> {human_bytes(footprint['file_bytes'])} on disk")
    if parts:
        text += ": " + ", ".join(parts)
    return text + "."


def _bpw(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".")


def _summary_quantize(report: dict[str, Any]) -> str:
    return _quantize_sentence(report, report.get("config") or {})


def _summary_qat(report: dict[str, Any]) -> str:
    text = _quantize_sentence(report, report.get("quantize_config") or {})
    qat = report.get("qat") or {}
    tokens = f" on {qat['train_tokens']} tokens" if "train_tokens" in qat else ""
    data = f" of {qat['data']}" if "data" in qat else ""
    return text + f" Then trained expert-side adapters by routing-replay QAT{tokens}{data}."


def _summary_prune_experts(report: dict[str, Any]) -> str:
    config = report.get("config") or {}
    before, after = report.get("experts_before"), report.get("experts_after")
    kept = sorted({len(layer["kept"]) for layer in (report.get("layers") or {}).values() if "kept" in layer})
    text = (
        f"Removed {before - after} of {before} routed experts"
        if before is not None and after is not None
        else "Removed routed experts"
    )
    details = [f"{key} {config[key]}" for key in ("method", "scope") if config.get(key)]
    if details:
        text += f" ({', '.join(details)})"
    if kept:
        text += f", keeping {kept[0] if len(kept) == 1 else f'{kept[0]}–{kept[-1]}'} per MoE layer"
    calibration = report.get("calibration") or {}
    if "tokens" in calibration and "source" in calibration:
        text += f"; experts were scored on {calibration['tokens']} calibration tokens of {calibration['source']}"
    return text + "."


def _summary_prune_heads(report: dict[str, Any]) -> str:
    unit = report.get("unit", "head")
    before, after = report.get("units_before"), report.get("units_after")
    text = f"Pruned attention {unit}s" + (f" from {before} to {after}" if before is not None and after else "")
    if report.get("distillation"):
        text += ", then distilled attention and norms against the source"
    return text + "."


def _summary_unknown(report: dict[str, Any]) -> str:
    return f"Ran the `{report['pass']}` pass."


_SUMMARIES: dict[str, Callable[[dict[str, Any]], str]] = {
    "quantize": _summary_quantize,
    "qat": _summary_qat,
    "prune_experts": _summary_prune_experts,
    "prune_heads": _summary_prune_heads,
}


# ---------------------------------------------------------------------------------------------------------------
# Measured table


def _evals(report: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The evaluated columns after the source: (label, EvalResult JSON), the final model last."""
    evaluation = report.get("eval") or {}
    if "after" in evaluation:
        return [("after PTQ, before QAT", evaluation.get("before") or {}), ("this model", evaluation["after"])]
    columns = []
    if report.get("eval_before_distillation"):
        columns.append(("before distillation", report["eval_before_distillation"]))
    columns.append(("this model", evaluation))
    return columns


def _measured(report: dict[str, Any]) -> list[str]:
    evals = _evals(report)
    final = evals[-1][1]
    reference = next((e["reference_perplexity"] for _, e in evals if "reference_perplexity" in e), None)
    source_fp, final_fp = report.get("source_footprint") or {}, report.get("footprint") or {}
    kv = report.get("kv_cache_bytes_per_token") or {}
    experts = [report.get("experts_before"), report.get("experts_after")]
    if experts[0] is None and "experts" in (report.get("outcome") or {}):
        experts = report["outcome"]["experts"]
    labels = ["source", *(label for label, _ in evals)]
    last = len(labels) - 1

    def row(name: str, cells: dict[int, Any], fmt: Callable[[Any], str]) -> list[str] | None:
        present = {i: v for i, v in cells.items() if v is not None}
        if not present:
            return None
        return [name, *(fmt(present[i]) if i in present else "—" for i in range(len(labels)))]

    def per_eval(key: str) -> dict[int, Any]:
        return {i + 1: e.get(key) for i, (_, e) in enumerate(evals)}

    rows = [
        row("perplexity", {0: reference, **per_eval("perplexity")}, lambda v: f"{v:.3f}"),
        row("KL(source ‖ model), nats/token", per_eval("kl"), lambda v: f"{v:.4f}"),
        row("top-k routing agreement with the source", per_eval("routing_agreement"), lambda v: f"{v:.4f}"),
        row("routed experts, all layers", {0: experts[0], last: experts[1]}, str),
        row(
            f"attention {report.get('unit', 'head')}s, all layers",
            {0: report.get("units_before"), last: report.get("units_after")},
            str,
        ),
        row("KV cache bytes per token", {0: kv.get("before"), last: kv.get("after")}, str),
        row("weights on disk", {0: source_fp.get("file_bytes"), last: final_fp.get("file_bytes")}, human_bytes),
        row(
            "bits/weight, whole model",
            {
                0: (source_fp.get("total") or {}).get("bits_per_weight"),
                last: (final_fp.get("total") or {}).get("bits_per_weight"),
            },
            lambda v: f"{v:.3f}",
        ),
    ]
    source_classes, final_classes = source_fp.get("classes") or {}, final_fp.get("classes") or {}
    for name, entry in final_classes.items():
        before = (source_classes.get(name) or {}).get("bits_per_weight")
        if entry.get("bits_per_weight") != before:
            rows.append(
                row(f"bits/weight, {name}", {0: before, last: entry.get("bits_per_weight")}, lambda v: f"{v:.3f}")
            )
    rows = [r for r in rows if r is not None]
    if not rows:
        return ["The report holds no measurements (the output was written without evaluation).", ""]
    used = [i for i in range(len(labels)) if any(r[i + 1] != "—" for r in rows)]
    lines = [
        "## Measured",
        "",
        "| | " + " | ".join(labels[i] for i in used) + " |",
        "|---|" + "---:|" * len(used),
        *("| " + r[0] + " | " + " | ".join(r[i + 1] for i in used) + " |" for r in rows),
        "",
    ]
    if final.get("data"):
        facts = [f"{final['tokens']} predicted tokens"] if "tokens" in final else []
        if "windows" in final and "seq_len" in final:
            facts.append(f"{final['windows']} windows of {final['seq_len']}")
        lines.append(
            f"Evaluated on {final['data']}" + (f" ({', '.join(facts)})" if facts else "") + "; KL and routing "
            "agreement compare each model's next-token distributions and top-k expert choices with the source's "
            "on the same tokens. The source is the input of the last pass."
        )
        lines.append("")
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Usage


def _needs_moecompress(chain: Sequence[dict[str, Any]], config: dict[str, Any]) -> bool:
    """Whether stock transformers needs ``import moecompress`` first (native quantised format, uneven layers)."""
    from ..quantization.formats import written_format

    layout = written_format(config.get("quantization_config") or {})
    if layout is not None and layout.needs_plugin:
        return True
    return any(report.get("uniform") is False or report.get("stock_loadable") is False for report in chain)


def _auto_class_name(architecture: str, model_type: str | None) -> str:
    """The auto class the card loads with: by the architecture's task, or transformers' multimodal-LM auto class
    where that task's class does not know the model type (Qwen3-Omni's release, which generates text and speech)."""
    from transformers.models.auto import modeling_auto

    auto = {
        "text-generation": "AutoModelForCausalLM",
        "image-text-to-text": "AutoModelForImageTextToText",
    }.get(_pipeline_tag(architecture) or "", "AutoModel")
    known = {
        "AutoModelForCausalLM": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "AutoModelForImageTextToText": modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        "AutoModel": modeling_auto.MODEL_MAPPING_NAMES,
    }[auto]
    if model_type not in known and model_type in modeling_auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES:
        return "AutoModelForMultimodalLM"
    return auto


def _usage(
    chain: Sequence[dict[str, Any]], config: dict[str, Any], architecture: str, repo: str, directory: Path
) -> list[str]:
    auto = _auto_class_name(architecture, config.get("model_type"))
    plugin = _needs_moecompress(chain, config)
    has_tokenizer = any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    lines = ["## How to load", ""]
    if plugin:
        lines.append(
            "This checkpoint loads in transformers once moecompress is imported: it registers the checkpoint's "
            "quantised expert format or per-layer expert/head counts with transformers."
        )
    else:
        lines.append("This checkpoint loads in stock transformers.")
    quantization = config.get("quantization_config") or {}
    from ..quantization.formats import written_format

    layout = written_format(quantization)
    if layout is not None and layout.card_note:
        lines.append(layout.card_note)
    code = ["```python"]
    if plugin:
        code.append("import moecompress  # noqa: F401  (registers the format with transformers)")
    code.append(f"from transformers import {auto}" + (", AutoTokenizer" if has_tokenizer else ""))
    code += ["", f'model = {auto}.from_pretrained("{repo}")']
    if has_tokenizer:
        code.append(f'tokenizer = AutoTokenizer.from_pretrained("{repo}")')
    code.append("```")
    return [*lines, "", *code, ""]
