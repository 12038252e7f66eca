"""Recipes: a YAML file naming the model, the calibration data and an ordered list of passes with their
parameters, validated completely before any work starts.

```yaml
model: builtin:tiny-moe
calibration: {source: builtin:prose, tokens: 16384, seq_len: 256, seed: 0}
passes:
  - prune_experts: {method: maep, ratio: 0.25}
  - quantize: {scheme: mxfp4}
  - lowrank: {lowrank_budget: 0.375}
  - eval: {data: builtin:prose, tokens: 16384}
```

A pass's parameters are its config dataclass's fields (``PruneExpertsConfig``, ``PruneHeadsConfig``,
``QuantizeConfig``, ``QATConfig`` with a nested ``quantize``); ``lowrank`` sets the low-rank fields of the
quantize pass just before it, which computes the adapters in its own sweep. Every error names the key's path
(``passes[1].quantize.scheme``) and is a :class:`UserInputError`.

Passes run one after another, each on the previous one's output (hidden sibling directories of the output,
removed at the end); the last compressing pass writes the output directory.
"""

from __future__ import annotations

import dataclasses
import shutil
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import UserInputError
from .passes.prune_experts import PruneExpertsConfig
from .passes.prune_heads import PruneHeadsConfig
from .passes.qat import QATConfig
from .passes.quantize import QuantizeConfig

CONFIGS: dict[str, type] = {
    "prune_experts": PruneExpertsConfig,
    "prune_heads": PruneHeadsConfig,
    "quantize": QuantizeConfig,
    "qat": QATConfig,
}
LOWRANK_KEYS = ("lowrank_budget", "lowrank_rank", "rank_alloc", "load_weighting", "lowrank_min_tokens")
PASS_NAMES = (*CONFIGS, "lowrank", "eval")


@dataclass(frozen=True)
class Calibration:
    source: str = "builtin:prose"
    tokens: int = 16384
    seq_len: int = 256
    seed: int = 0


@dataclass(frozen=True)
class Evaluation:
    data: str = "builtin:prose"
    tokens: int | None = 16384


@dataclass
class Recipe:
    model: str | None
    calibration: Calibration
    passes: list[tuple[str, Any]] = field(default_factory=list)
    """``(pass name, config)`` in order; ``lowrank`` is already folded into its quantize pass."""
    evaluation: Evaluation | None = None


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _coerce(value: Any, annotation: Any, path: str) -> Any:
    """``value`` from YAML as ``annotation`` (the dataclass field's type), or a UserInputError naming ``path``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, path)
            except UserInputError as error:
                errors.append(error)
        raise errors[0]
    if origin is typing.Literal:
        if value not in args:
            raise UserInputError(f"{path}: {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise UserInputError(f"{path}: expected a list, got {type(value).__name__}")
        return tuple(_coerce(item, args[0], f"{path}[{i}]") for i, item in enumerate(value))
    if dataclasses.is_dataclass(annotation):
        return _dataclass(annotation, value, path)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(annotation)
    if ok is None:
        raise UserInputError(f"{path}: cannot be set from a recipe")
    if not ok:
        raise UserInputError(f"{path}: expected {_type_name(annotation)}, got {value!r}")
    return float(value) if annotation is float else value


def _dataclass(cls: type, values: Any, path: str) -> Any:
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise UserInputError(f"{path}: expected a mapping of parameters, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise UserInputError(f"{path}.{unknown[0]}: unknown key; {path} takes {', '.join(names)}")
    return cls(**{key: _coerce(value, hints[key], f"{path}.{key}") for key, value in values.items()})


def _validated(config: Any, path: str) -> None:
    try:
        config.validate()
    except UserInputError as error:
        raise UserInputError(f"{path}: {error}") from None


def parse_recipe(document: Any, source: str = "recipe") -> Recipe:
    """A validated :class:`Recipe` from a parsed YAML document."""
    if not isinstance(document, dict):
        raise UserInputError(f"{source}: a recipe is a mapping with model, calibration and passes")
    unknown = sorted(set(document) - {"model", "calibration", "passes"})
    if unknown:
        raise UserInputError(f"{unknown[0]}: unknown key; a recipe takes model, calibration, passes")
    model = document.get("model")
    if model is not None and not isinstance(model, str):
        raise UserInputError(f"model: expected a model directory, builtin:NAME or a hub id, got {model!r}")
    calibration = _dataclass(Calibration, document.get("calibration"), "calibration")
    if calibration.tokens < calibration.seq_len:
        raise UserInputError(f"calibration.tokens: {calibration.tokens} is less than one window (seq_len)")
    steps = document.get("passes")
    if not isinstance(steps, list) or not steps:
        raise UserInputError("passes: expected a non-empty list of passes")
    recipe = Recipe(model, calibration)
    quantized_at: str | None = None
    for index, step in enumerate(steps):
        where = f"passes[{index}]"
        if not isinstance(step, dict) or len(step) != 1:
            raise UserInputError(f"{where}: each pass is a mapping with one key, the pass name")
        ((name, params),) = step.items()
        path = f"{where}.{name}"
        if name not in PASS_NAMES:
            raise UserInputError(f"{path}: unknown pass; choose from {', '.join(PASS_NAMES)}")
        if recipe.evaluation is not None:
            raise UserInputError(f"{path}: eval must be the last pass")
        if name == "eval":
            recipe.evaluation = _dataclass(Evaluation, params, path)
            continue
        if name == "lowrank":
            previous = recipe.passes[-1] if recipe.passes else None
            if previous is None or previous[0] != "quantize" or index == 0 or "lowrank" in steps[index - 1]:
                raise UserInputError(f"{path}: lowrank must directly follow a quantize pass")
            params = params or {}
            if not isinstance(params, dict) or sorted(set(params) - set(LOWRANK_KEYS)):
                extra = sorted(set(params) - set(LOWRANK_KEYS)) if isinstance(params, dict) else ["(not a mapping)"]
                raise UserInputError(f"{path}.{extra[0]}: unknown key; lowrank takes {', '.join(LOWRANK_KEYS)}")
            merged = {**dataclasses.asdict(previous[1]), **params}
            config = _dataclass(QuantizeConfig, merged, path)
            _validated(config, path)
            recipe.passes[-1] = ("quantize", config)
            continue
        if name in ("prune_experts", "prune_heads") and quantized_at:
            raise UserInputError(f"{path}: pruning must come before quantisation ({quantized_at})")
        if name in ("quantize", "qat"):
            if quantized_at:
                raise UserInputError(f"{path}: the model is already quantised by {quantized_at}")
            quantized_at = path
        config = _dataclass(CONFIGS[name], params, path)
        _validated(config, path)
        recipe.passes.append((name, config))
    if not recipe.passes:
        raise UserInputError("passes: the recipe has no compressing pass (only eval)")
    return recipe


def load_recipe(path: Path) -> Recipe:
    try:
        document = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise UserInputError(f"{path}: cannot read the recipe ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise UserInputError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from None
    return parse_recipe(document, str(path))


def describe(recipe: Recipe) -> list[str]:
    """One line per pass with the parameters that differ from the defaults."""
    lines = []
    for name, config in recipe.passes:
        defaults = type(config)()
        changed = {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(defaults, f.name)
        }
        lines.append(f"{name}: " + (", ".join(f"{k}={v}" for k, v in changed.items()) or "defaults"))
    if recipe.evaluation is not None:
        lines.append(f"eval: data={recipe.evaluation.data}, tokens={recipe.evaluation.tokens}")
    return lines


def run_recipe(
    recipe: Recipe, model_dir: Path, out_dir: Path, *, overwrite: bool = False, progress: bool = True
) -> dict[str, Any]:
    """Run the passes in order; returns the last pass's report, with the recipe and the evaluation added."""
    from .evals.perplexity import evaluate
    from .passes.prune_experts import prune_experts, update_report
    from .passes.prune_heads import prune_heads
    from .passes.qat import qat_checkpoint
    from .passes.quantize import quantize_checkpoint

    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise UserInputError(f"{out_dir.absolute()}: output directory exists (pass --overwrite to replace it)")
    calib = recipe.calibration
    common = dict(calib=calib.source, calib_tokens=calib.tokens, seq_len=calib.seq_len, eval_data=None)
    intermediates = [out_dir.absolute().parent / f".{out_dir.name}.step-{i}" for i in range(len(recipe.passes))]
    source, report = model_dir, {}
    try:
        for index, (name, config) in enumerate(recipe.passes):
            last = index == len(recipe.passes) - 1
            target = out_dir if last else intermediates[index]
            options = dict(overwrite=True if not last else overwrite, progress=progress)
            if name == "prune_experts":
                report = prune_experts(source, target, config, **common, **options)
            elif name == "prune_heads":
                report = prune_heads(source, target, config, **common, **options)
            elif name == "quantize":
                report = quantize_checkpoint(source, target, config, **common, **options)
            else:
                report = qat_checkpoint(
                    source, target, config, data=calib.source, calib_tokens=calib.tokens, eval_data=None, **options
                )
            source = target
    finally:
        for directory in intermediates[:-1]:
            shutil.rmtree(directory, ignore_errors=True)
    report["recipe"] = {"model": str(model_dir), "passes": describe(recipe)}
    if recipe.evaluation is not None:
        result = evaluate(
            out_dir,
            recipe.evaluation.data,
            seq_len=calib.seq_len,
            max_tokens=recipe.evaluation.tokens,
            reference_dir=model_dir,
            progress=progress,
        )
        report["eval"] = {"data": recipe.evaluation.data, **result.to_json()}
    update_report(out_dir, report)
    return report
