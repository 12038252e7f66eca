"""Every Mixture-of-Experts ``model_type`` of the installed transformers and what moecompress does with it (issue 42,
item 3), so that a new transformers release shows at once which families have no adapter.

The MoE types are found in transformers' own registries: every ``model_type`` of ``CONFIG_MAPPING`` whose config
class, or one of its sub-configs (``text_config``, a thinker's ``text_config``...), declares a routed-expert count
(:data:`EXPERT_COUNT_KEYS`, the keys moecompress's adapters and its refusal read). Whether the type's modeling
module defines an experts module (a class named ``*Experts`` or ``*MoE``/``*SparseMoeBlock``) is printed beside it;
types with such a module but no expert count (the vision or audio configs of a MoE model's module) are listed
apart and not counted. The status of each type is what moecompress's adapter lookup says about a tiny config of
the stock config class (hidden 64, 2 layers, 8 experts; the tests' ``TINY_CONFIGS`` where moecompress has one).

    python scripts/family_sweep.py                      # the table, plain text
    python scripts/family_sweep.py --markdown           # the table as markdown
    python scripts/family_sweep.py --update-doc docs/families.md   # rewrite the generated section of the doc
    python scripts/family_sweep.py --check --types qwen3_moe,mixtral   # the end-to-end checks on tiny checkpoints
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_CLASSES = (
    re.compile(r"^class (\w*(?<!Shared)Experts)\(", re.M),
    re.compile(r"^class (\w*Experts)\(", re.M),
    re.compile(r"^class (\w*(?:MoE|SparseMoeBlock|MoeBlock))\(", re.M),
)
TINY_SIZES: dict[str, int] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=384,
    max_position_embeddings=128,
    num_experts_per_tok=2,
)
RELEASE_ONLY = {"kimi_k2": "release config (Kimi-K2)"}
"""Model types of hub releases' ``config.json`` that transformers does not register, listed as well."""
MOE_RELEASES = {"mistral3": ("text_config.n_routed_experts", "Mistral4Experts")}
"""Types transformers registers with a dense default config, listed for a MoE release of theirs (Mistral Small 4:
``mistral3`` with a ``mistral4`` text config): ``(where the expert count is, the experts class)``."""
BEGIN, END = "<!-- family_sweep: begin -->", "<!-- family_sweep: end -->"


@dataclasses.dataclass
class MoEType:
    model_type: str
    config_class: str
    evidence: str
    """Where the routed-expert count is declared (``text_config.num_experts``)."""
    experts_module: str
    """The modeling module's experts class (empty when it has none)."""
    kind: str
    status: str = ""
    reason: str = ""
    tiny_config: str = ""
    """How the config handed to moecompress was made."""
    checks: dict[str, str] = dataclasses.field(default_factory=dict)


# ---- enumeration ----------------------------------------------------------------------------------------------
def _fields(config_class: type) -> tuple[set[str], set[str]]:
    """The attributes ``config_class`` declares, and the aliases of its ``attribute_map``."""
    names = (
        {field.name for field in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    )
    aliases: set[str] = set()
    for klass in config_class.__mro__:
        names |= set(getattr(klass, "__annotations__", {}))
        aliases |= set(getattr(klass, "attribute_map", {}) or {})
    return names, aliases


def _sub_config_classes(config_class: type, model_type: str) -> dict[str, type]:
    """``config_class.sub_configs``, with an ``AutoConfig`` entry replaced by the class its default holds."""
    subs = dict(getattr(config_class, "sub_configs", {}) or {})
    if any(not hasattr(sub, "sub_configs") or sub.__name__ == "AutoConfig" for sub in subs.values()):
        default = _default_config(config_class)
        for name, sub in subs.items():
            value = getattr(default, name, None) if default is not None else None
            subs[name] = type(value) if value is not None and hasattr(value, "to_dict") else sub
    return subs


def _default_config(config_class: type) -> Any:
    try:
        return config_class()
    except Exception:
        return None


def expert_key(config_class: type, model_type: str, depth: int = 0) -> str:
    """The path of the routed-expert count in ``config_class`` or its sub-configs, or ``""``."""
    declared, aliases = _fields(config_class)
    own = [key for key in EXPERT_COUNT_KEYS if key in declared] + [key for key in EXPERT_COUNT_KEYS if key in aliases]
    if own:
        return own[0]
    if depth >= 2:
        return ""
    for name, sub in _sub_config_classes(config_class, model_type).items():
        if isinstance(sub, type) and sub.__name__ != "AutoConfig":
            found = expert_key(sub, model_type, depth + 1)
            if found:
                return f"{name}.{found}"
    return ""


def experts_module(config_class: type) -> str:
    """The first experts class defined in the modeling files beside ``config_class``'s module, or ``""``."""
    sources = [path.read_text() for path in sorted(Path(inspect.getfile(config_class)).parent.glob("modeling_*.py"))]
    for pattern in EXPERTS_CLASSES:
        for source in sources:
            match = pattern.search(source)
            if match:
                return match.group(1)
    return ""


def _kind(model_type: str, config_class: type, parents: dict[type, str]) -> str:
    from transformers.models.auto import modeling_auto as auto

    if model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal LM"
    for mapping, name in (
        (auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, "image-text-to-text"),
        (auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES, "multimodal LM"),
        (auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, "seq2seq LM"),
    ):
        if model_type in mapping:
            return name
    if config_class in parents:
        return f"sub-config of {parents[config_class]}"
    tasks = [
        name.removeprefix("MODEL_FOR_").removesuffix("_MAPPING_NAMES").lower()
        for name, mapping in vars(auto).items()
        if name.startswith("MODEL_FOR_") and name.endswith("_MAPPING_NAMES") and model_type in mapping
    ]
    return tasks[0] if tasks else ("base model" if model_type in auto.MODEL_MAPPING_NAMES else "config only")


def enumerate_moe_types() -> tuple[list[MoEType], list[tuple[str, str]]]:
    """The MoE types (config evidence), and ``(model_type, experts class)`` of those with an experts module in their
    modeling files but no expert count anywhere in their config (not counted)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    classes: dict[str, type] = {}
    for model_type in CONFIG_MAPPING_NAMES:
        try:
            classes[model_type] = CONFIG_MAPPING[model_type]
        except Exception:
            continue
    parents = {
        sub: model_type
        for model_type, klass in classes.items()
        for sub in (getattr(klass, "sub_configs", {}) or {}).values()
        if isinstance(sub, type)
    }
    found, module_only = [], []
    for model_type, klass in classes.items():
        key = expert_key(klass, model_type)
        module = experts_module(klass)
        if key:
            found.append(MoEType(model_type, klass.__name__, key, module, _kind(model_type, klass, parents)))
        elif module:
            module_only.append((model_type, module))
    for model_type, (evidence, module) in MOE_RELEASES.items():
        klass = classes[model_type]
        found.append(MoEType(model_type, klass.__name__, evidence, module, _kind(model_type, klass, parents)))
    for model_type, what in RELEASE_ONLY.items():
        found.append(MoEType(model_type, "DeepseekV3Config", "n_routed_experts", "DeepseekV3Experts", what))
    return found, module_only


# ---- status ---------------------------------------------------------------------------------------------------
def _shrink(section: dict[str, Any], keys: set[str]) -> None:
    """Set the sizes named in ``keys`` (``TINY_SIZES`` keys, or ``experts`` for the expert counts) in ``section`` and
    in its sub-sections that describe a decoder; ``num_hidden_layers`` also cuts the per-layer lists."""
    layers = section.get("num_hidden_layers")
    for key, value in list(section.items()):
        if isinstance(value, dict) and any(k in value for k in (*EXPERT_COUNT_KEYS, "num_hidden_layers")):
            _shrink(value, keys)
        elif key in TINY_SIZES and key in keys and isinstance(value, int) and not isinstance(value, bool):
            section[key] = TINY_SIZES[key]
        elif key in EXPERT_COUNT_KEYS and "experts" in keys and (value is None or isinstance(value, int)):
            section[key] = 8  # also where the default is None or 0: a config that can be dense (Gemma 4) made MoE
        elif (
            "num_hidden_layers" in keys and isinstance(value, list) and isinstance(layers, int) and len(value) == layers
        ):
            section[key] = value[: TINY_SIZES["num_hidden_layers"]]


def _built(model_type: str, default: dict[str, Any], keys: set[str]) -> dict[str, Any] | None:
    """The stock class's config with the sizes ``keys`` set, or None where the class refuses them."""
    import copy

    from transformers import AutoConfig

    config = copy.deepcopy(default)
    _shrink(config, keys)
    try:
        return AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"}).to_dict()
    except Exception:
        return None


def tiny_config(model_type: str) -> tuple[dict[str, Any], str]:
    """``(config.json contents, how it was made)``: the tests' tiny config where moecompress has one, else the stock
    config class with 8 experts and the sizes of :data:`TINY_SIZES` (each size the class refuses left at its
    default)."""
    from transformers import AutoConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from synthetic import _RELEASE_CONFIG, TINY_CONFIGS
    from synthetic import tiny_config as family_config

    if model_type in RELEASE_ONLY:
        return {**family_config(model_type).to_dict(), **_RELEASE_CONFIG[model_type]}, "TINY_CONFIGS + release"
    if model_type in TINY_CONFIGS:
        return family_config(model_type).to_dict(), "TINY_CONFIGS"
    default = AutoConfig.for_model(model_type).to_dict()
    every = {"experts", *TINY_SIZES}
    config = _built(model_type, default, every)
    if config is not None:
        return config, "stock class, tiny sizes"
    kept: set[str] = set()
    config = default
    for key in ("experts", *TINY_SIZES):
        trial = _built(model_type, default, kept | {key})
        if trial is not None:
            kept.add(key)
            config = trial
    refused = ", ".join(key for key in ("experts", *TINY_SIZES) if key not in kept)
    return config, f"stock class, tiny sizes but the default {refused}"


def _one_line(message: str) -> str:
    """moecompress's message without the ``source: `` prefix and the list of supported families it ends with."""
    message = message.split(": ", 1)[1] if message.startswith("sweep: ") else message
    return re.split(r"; supported (?:MoE )?families: ", message)[0]


def status_of(entry: MoEType) -> None:
    """Fill ``entry.status`` (supported / refused / error) and ``entry.reason`` from moecompress's adapter lookup."""
    from moecompress.errors import UserInputError
    from moecompress.families import adapter_for

    try:
        config, entry.tiny_config = tiny_config(entry.model_type)
        adapter = adapter_for(config, source="sweep")
        shape = adapter.shape()
    except UserInputError as error:
        entry.status, entry.reason = "refused", _one_line(str(error))
        return
    except Exception as error:
        entry.status, entry.reason = "error", f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
        return
    entry.status = "supported"
    entry.reason = (
        f"{adapter.family}: {len(shape.moe_layers)}/{shape.num_layers} MoE layers, "
        f"{max(shape.experts_per_layer.values())} experts, top-{shape.top_k}"
    )


# ---- end-to-end checks ----------------------------------------------------------------------------------------
CHECKS = ("inspect", "prune", "mxfp4", "recipe", "streamed")
SEQ_LEN, EVAL_TOKENS, CALIB_TOKENS = 64, 256, 512


def _test_helpers() -> Any:
    """tests/helpers.py (its ``load_stock``: the model stock transformers builds from a directory)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import helpers

    return helpers


def _cli(*args: Any) -> str:
    from click.testing import CliRunner

    from moecompress.cli.main import app

    result = CliRunner().invoke(app, [str(arg) for arg in args])
    if result.exit_code != 0:
        lines = result.output.strip().splitlines()
        raise RuntimeError(lines[-1] if lines else repr(result.exception))
    return result.output


def _adapter(directory: Path) -> Any:
    import json

    from moecompress.families import adapter_for

    return adapter_for(json.loads((directory / "config.json").read_text()))


def _logits(model: Any, adapter: Any, source: Path) -> Any:
    """The logits of two windows of random tokens; an encoder-decoder's are its decoder's, on the windows'
    span corruption as the evaluation makes it (source and decoder input, the tokenizer of ``source``)."""
    import torch

    vocab = int(adapter.text_config["vocab_size"])
    ids = torch.randint(3, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids}
    if adapter.encoder_output_norm is not None:
        from transformers import AutoTokenizer

        from moecompress.calibration.span_corruption import seq2seq_windows
        from moecompress.evals.perplexity import SEQ2SEQ_SEED

        windows = seq2seq_windows(ids, torch.zeros_like(ids), AutoTokenizer.from_pretrained(source), adapter.config,
                                  SEQ2SEQ_SEED)  # fmt: skip
        inputs = {"input_ids": windows.input_ids, "decoder_input_ids": windows.decoder_input_ids}
    with torch.no_grad():
        return model(**inputs).logits


def _mask_experts(
    model: Any,
    adapter: Any,
    source: Path,
    removed: dict[int, list[int]],
    attention: dict[int, list[int]] | None = None,
) -> None:
    """Route ``model`` (the stock model of ``source``) around the ``removed`` experts of each layer with the family's
    rule, as the calibration sweep does for a pruned layer, and its attention around the ``attention`` experts
    removed where the attention has experts of its own (JetMoE's MoA)."""
    import torch

    from moecompress.checkpoint import CheckpointReader
    from moecompress.checkpoint.stream import group_keys_by_layer

    with CheckpointReader(source) as reader:
        keys, _ = group_keys_by_layer(reader, adapter)
        for layer, ids in removed.items():
            moe, _, _ = adapter.split_layer(layer, reader.read(keys[layer]))
            allowed = torch.ones(moe.router_columns, dtype=torch.bool)
            allowed[ids] = False

            def choose(logits, moe=moe, allowed=allowed, token_ids=None):
                return adapter.route(moe, logits, allowed, token_ids)

            adapter.reroute_hooks(adapter.decoder_layers(model)[layer], choose)
        for layer, ids in (attention or {}).items():
            allowed = torch.ones(len(adapter.original_attention_expert_ids(layer)), dtype=torch.bool)
            allowed[ids] = False
            adapter.attention_reroute_hooks(adapter.decoder_layers(model)[layer], allowed)


def check_inspect(source: Path, work: Path) -> None:
    import json

    summary = json.loads(_cli("inspect", source, "--json"))
    adapter = _adapter(source)
    assert (summary["family"], summary["moe_layers"]) == (adapter.family, adapter.moe_layers()), summary["family"]


def check_prune(source: Path, work: Path) -> None:
    """prune --scope layer; stock transformers loads the output with nothing missing, unexpected or mismatched, and
    its logits equal the input's with the removed experts masked out of routing."""
    import json

    import torch
    import transformers

    adapter = _adapter(source)
    keep = adapter.num_experts // 2
    _cli("prune", source, "--out", work, "--keep", keep, "--scope", "layer", "--calib-tokens", CALIB_TOKENS,
         "--seq-len", SEQ_LEN, "--eval-tokens", EVAL_TOKENS)  # fmt: skip
    pruned = _adapter(work)
    config = pruned.transformers_config()
    _, loading = getattr(transformers, pruned.auto_class).from_pretrained(
        work, dtype=torch.float32, output_loading_info=True, **({} if config is None else {"config": config})
    )
    problems = {kind: loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys") if loading[kind]}
    assert not problems, problems
    report = json.loads((work / "moecompress_report.json").read_text())
    layers = {int(layer): entry for layer, entry in report["layers"].items() if int(layer) < adapter.num_layers}
    removed = {layer: entry["removed"] for layer, entry in layers.items()}
    attention = {layer: entry["attention_removed"] for layer, entry in layers.items() if "attention_removed" in entry}
    helpers = _test_helpers()
    reference = helpers.load_stock(source)
    _mask_experts(reference, adapter, source, removed, attention)
    got, want = _logits(helpers.load_stock(work), adapter, source), _logits(reference, adapter, source)
    # a looped segment runs its layers once per pass, which multiplies float32 rounding between two model copies
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 if adapter.loop_passes > 1 else 1e-5)


def check_mxfp4(source: Path, work: Path) -> None:
    """quantize --scheme mxfp4; transformers loads the output through the plugin, QuantizedExperts in every MoE
    layer, finite logits."""
    import torch

    import moecompress  # noqa: F401 - the plugin

    _cli("quantize", source, "--out", work, "--scheme", "mxfp4", "--seq-len", SEQ_LEN, "--eval-tokens", EVAL_TOKENS)
    adapter = _adapter(work)
    model = _test_helpers().load_stock(work)
    kinds = {type(adapter.experts_of(model, layer)).__name__ for layer in adapter.moe_layers()}
    assert kinds == {"QuantizedExperts"}, kinds
    assert torch.isfinite(_logits(model, adapter, source)).all()


def check_recipe(source: Path, work: Path) -> None:
    """recipes/default.yaml's passes (calibration and evaluation cut to tiny sizes) on the checkpoint."""
    import math

    import yaml

    from moecompress.runner.recipes import parse_recipe, run_recipe

    document = yaml.safe_load((ROOT / "recipes" / "default.yaml").read_text())
    document.pop("model", None)
    document["calibration"].update(tokens=CALIB_TOKENS, seq_len=SEQ_LEN)
    for step in document["passes"]:
        if "eval" in step:
            step["eval"]["tokens"] = EVAL_TOKENS
    report = run_recipe(parse_recipe(document, "default.yaml"), source, work, progress=False)
    assert math.isfinite(report["eval"]["perplexity"]), report["eval"]
    check_inspect(work, work)


def check_streamed(source: Path, work: Path) -> None:
    """Streamed evaluation of the mxfp4 output against the source gives the whole-model evaluation's figures."""
    from moecompress.evals.perplexity import evaluate

    _test_helpers()
    from test_eval_streamed import assert_same_figures

    model = work.parent / "mxfp4" if (work.parent / "mxfp4" / "config.json").exists() else source
    options = dict(seq_len=32, max_tokens=EVAL_TOKENS, reference_dir=source, progress=False)
    assert_same_figures(
        evaluate(model, "builtin:prose", **options), evaluate(model, "builtin:prose", **options, whole_model=True)
    )


CHECK_FUNCTIONS = dict(
    inspect=check_inspect, prune=check_prune, mxfp4=check_mxfp4, recipe=check_recipe, streamed=check_streamed
)


def run_checks(entry: MoEType, work: Path) -> None:
    """The five checks of issue 42 on a tiny checkpoint of ``entry``'s type, each ``ok`` or why not."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from synthetic import TINY_CONFIGS, save_tiny_model, tiny_tokenizer_for

    if entry.model_type not in TINY_CONFIGS:
        entry.checks = dict.fromkeys(CHECKS, "no tiny checkpoint")
        return
    source = save_tiny_model(entry.model_type, work / entry.model_type / "source")
    tiny_tokenizer_for(entry.model_type).save_pretrained(source)
    for name in CHECKS:
        try:
            CHECK_FUNCTIONS[name](source, work / entry.model_type / name)
            entry.checks[name] = "ok"
        except Exception as error:
            message = str(error).strip().splitlines()[0][:120] if str(error).strip() else ""
            entry.checks[name] = f"FAIL {type(error).__name__}: {message}"


# ---- output ---------------------------------------------------------------------------------------------------
def counts(entries: list[MoEType]) -> dict[str, int]:
    out = {"MoE types": len(entries)}
    for status in ("supported", "refused", "error"):
        out[status] = sum(entry.status == status for entry in entries)
    return out


def plain_table(entries: list[MoEType], module_only: list[tuple[str, str]]) -> str:
    lines = [f"{'model_type':<28} {'status':<10} {'expert count':<28} {'experts module':<28} {'kind':<24} reason"]
    for e in entries:
        lines.append(
            f"{e.model_type:<28} {e.status:<10} {e.evidence:<28} {e.experts_module or '-':<28} {e.kind:<24} "
            f"{e.reason} [{e.tiny_config}]"
        )
        lines.extend(f"{'':<28}   {name}: {result}" for name, result in e.checks.items())
    lines.append(", ".join(f"{name} {count}" for name, count in counts(entries).items()))
    lines.append(
        "experts module but no expert count in the config (not counted): "
        + ", ".join(f"{name} ({module})" for name, module in module_only)
    )
    return "\n".join(lines)


def markdown(entries: list[MoEType], module_only: list[tuple[str, str]], command: str) -> str:
    import transformers

    tally = counts(entries)
    released = sum(e.model_type in RELEASE_ONLY for e in entries)
    kinds = Counter(e.kind.split(" of ")[0] for e in entries if e.model_type not in RELEASE_ONLY)
    by_kind = ", ".join(f"{kind} {count}" for kind, count in kinds.most_common())
    checked = any(e.checks for e in entries)
    head = ["`model_type`", "kind", "expert count", "experts module", "status", "config asked"]
    head += list(CHECKS) if checked else []
    rows = [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for e in entries:
        status = f"supported ({e.reason})" if e.status == "supported" else f"{e.status}: {e.reason}"
        cells = [f"`{e.model_type}`", e.kind, f"`{e.evidence}`", f"`{e.experts_module}`" if e.experts_module else "—"]
        cells += [status.replace("|", "\\|"), e.tiny_config]
        if checked:
            cells += [e.checks.get(name, "") for name in CHECKS]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(
        [
            BEGIN,
            f"Generated by `{command}` with transformers {transformers.__version__} (do not edit by hand). "
            f"{tally['MoE types']} MoE types ({released} release config, the others registered by transformers; "
            f"{by_kind}): {tally['supported']} supported, {tally['refused']} refused, {tally['error']} errors.",
            "",
            "A type is MoE when its config class or one of its sub-configs declares a routed-expert count ("
            + ", ".join(f"`{key}`" for key in EXPERT_COUNT_KEYS)
            + "); the experts module is the first `*Experts` / `*MoE` class of its modeling files. The status is "
            "what `adapter_for` (what `inspect` and every command call first) says about a tiny config of the stock "
            "config class (config asked: the tests' `TINY_CONFIGS` entry, or the stock class with 8 experts, hidden "
            "64, 2 layers..., each size the class refuses left at its default); a refusal is its message, without "
            "the list of supported families it ends with.",
            "",
            *rows,
            "",
            "Not counted (an experts class in the modeling files, no expert count in the config): "
            + ", ".join(f"`{name}`" for name, _ in module_only)
            + ".",
            END,
        ]
    )


def update_doc(path: Path, section: str) -> None:
    """Replace the generated section of ``path`` (between the markers), read right before writing."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} section to replace")
    before, rest = text.split(BEGIN, 1)
    path.write_text(before + section + rest.split(END, 1)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default=None, help="Comma-separated model types to list (default: all MoE types).")
    parser.add_argument("--check", action="store_true", help="Run the end-to-end checks on the supported types.")
    parser.add_argument("--work-dir", type=Path, default=None, help="Where --check writes its checkpoints.")
    parser.add_argument("--markdown", action="store_true", help="Print the table as markdown.")
    parser.add_argument("--update-doc", type=Path, default=None, help="Rewrite this file's generated section.")
    args = parser.parse_args(argv)

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    entries, module_only = enumerate_moe_types()
    if args.types:
        wanted = [name.strip() for name in args.types.split(",") if name.strip()]
        unknown = sorted(set(wanted) - {e.model_type for e in entries})
        if unknown:
            parser.error(f"--types: not MoE types of this transformers: {', '.join(unknown)}")
        entries = [e for e in entries if e.model_type in wanted]
    for entry in entries:
        status_of(entry)
    if args.check:
        import tempfile

        with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
            for entry in entries:
                if entry.status == "supported":
                    run_checks(entry, Path(work))
    command = "python scripts/family_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.update_doc:
        update_doc(args.update_doc, markdown(entries, module_only, command.strip()))
    elif args.markdown:
        print(markdown(entries, module_only, command.strip()))
    else:
        print(plain_table(entries, module_only))
    return 1 if any(e.status == "error" or any(r.startswith("FAIL") for r in e.checks.values()) for e in entries) else 0


if __name__ == "__main__":
    sys.exit(main())
