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
``QuantizeConfig``, ``QATConfig`` with a nested ``quantize``; all listed in docs/recipe_keys.md); ``lowrank`` sets
the low-rank fields of the quantize pass just before it, which computes the adapters in its own sweep. Every error
names the key's path (``passes[1].quantize.scheme``) and is a :class:`UserInputError`.

Passes run one after another, each on the previous one's output (hidden sibling directories of the output,
removed at the end); the last compressing pass writes the output directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..calibration import distributed
from ..checkpoint.stream import check_output_is_not_input
from ..checkpoint.writer import INCOMPLETE_MARKER, file_sha256, hidden_dir, output_exists
from ..defaults import (
    CALIBRATION_LEAST,
    DEFAULT_CALIB_TOKENS,
    DEFAULT_DATA,
    DEFAULT_EVAL_DATA,
    DEFAULT_EVAL_TOKENS,
    DEFAULT_IMAGE_SIZE,
    DEFAULT_SEQ_LEN,
    DEVICE_CHOICES,
    EVAL_TOKENS_LEAST,
)
from ..errors import OptionError, UserInputError
from ..files import DiskFullError, is_full, write_json, write_text
from ..passes.options import KINDS, nested_configs, refuse_unused
from ..passes.options import short as _short
from ..passes.quantize import QuantizeConfig
from ..passes.registry import PASSES
from ..progress import end_of_command, event
from ..vocabulary import RecipeKeys, named
from . import recipe_yaml
from .threads import check_resume_threads, thread_count

LOWRANK_KEYS = (
    "lowrank_budget",
    "lowrank_rank",
    "rank_alloc",
    "load_weighting",
    "sensitivity",
    "lowrank_min_tokens",
)


def pass_names() -> tuple[str, ...]:
    """What a recipe step may name: the registered passes (:data:`~moecompress.passes.registry.PASSES`, read at
    parse time, so a pass registered later is known), ``lowrank`` and ``eval``."""
    return (*PASSES, "lowrank", "eval")


@dataclass(frozen=True)
class Calibration:
    source: str = DEFAULT_DATA
    tokens: int = DEFAULT_CALIB_TOKENS
    seq_len: int = DEFAULT_SEQ_LEN
    seed: int = 0
    """The seed of the calibration windows (and of every pass that does not set its own)."""
    image_size: int = DEFAULT_IMAGE_SIZE
    """Side in pixels of calibration images (image+caption sources of vision-language models)."""


@dataclass(frozen=True)
class Evaluation:
    data: str = DEFAULT_EVAL_DATA
    tokens: int | None = DEFAULT_EVAL_TOKENS
    """Tokens evaluated; None evaluates the whole source."""


@dataclass
class Recipe:
    model: str | None
    calibration: Calibration
    passes: list[tuple[str, Any]] = field(default_factory=list)
    """``(pass name, config)`` in order; ``lowrank`` is already folded into its quantize pass."""
    evaluation: Evaluation | None = None
    device: str | None = None
    """Where the layers compute: auto (the default; CUDA when torch sees one), cpu, cuda or cuda:N."""
    vocabulary: Any = field(default=None, repr=False, compare=False)
    """How the caller spells options in messages (:mod:`moecompress.vocabulary`); None: the command line."""


class _BadValue(Exception):
    """A value of the wrong type; the key holding it is named by :func:`_dataclass`."""


def _coerce(value: Any, annotation: Any, path: str) -> Any:
    """``value`` from YAML as ``annotation`` (the dataclass field's type), or :class:`_BadValue`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, path)
            except _BadValue as error:
                errors.append(error)
        raise errors[0]
    if origin is typing.Literal:
        if value not in args:
            raise _BadValue(f"is not one of {', '.join(map(str, args))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _BadValue("is not a list")
        items = []
        for i, item in enumerate(value):
            try:
                items.append(_coerce(item, args[0], f"{path}[{i}]"))
            except _BadValue as error:
                raise _BadValue(f"(item {i}) {error}") from None
        return tuple(items)
    if dataclasses.is_dataclass(annotation):
        return _dataclass(annotation, value, path)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(annotation)
    if ok is None:
        raise _BadValue("cannot be set from a recipe")
    if not ok:
        raise _BadValue(f"is not {KINDS[annotation]}")
    if annotation is float and not math.isfinite(value):
        raise _BadValue("is not a finite number")
    return float(value) if annotation is float else value


SECTION_OWNERS: dict[type, str] = {Calibration: "calibration", Evaluation: "evaluation"}
"""The run's own sections, as messages name their owners (:mod:`moecompress.vocabulary`)."""


def _dataclass(cls: type, values: Any, path: str) -> Any:
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise UserInputError(f"{path}: expected a mapping of parameters, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names), key=str)
    if unknown:
        raise UserInputError(f"{path}.{_short(unknown[0])}: unknown key; {path} takes {', '.join(names)}")
    owner = SECTION_OWNERS.get(cls, cls)
    coerced = {}
    for key, value in values.items():
        try:
            coerced[key] = _coerce(value, hints[key], f"{path}.{key}")
        except _BadValue as error:
            prefix = f"{owner}." if isinstance(owner, str) else ""
            shown = value if isinstance(value, (bool, int, float)) else _short(value)
            raise OptionError(f"{named(prefix + key, shown)} {error}", owner) from None
    return cls(**coerced)


def _validated(config: Any, path: str) -> None:
    try:
        config.validate()
    except OptionError:
        raise
    except UserInputError as error:
        raise UserInputError(f"{path}: {error}") from None


def _check_calibration(calibration: Calibration) -> None:
    for key, least in CALIBRATION_LEAST.items():
        value = getattr(calibration, key)
        if value < least:
            raise OptionError(f"{named('calibration.' + key, value)} must be at least {least}")
    if calibration.tokens < calibration.seq_len:
        raise OptionError(
            f"{named('calibration.tokens', calibration.tokens)} is less than one window of "
            f"{named('calibration.seq_len', calibration.seq_len)}"
        )


def _check_evaluation(evaluation: Evaluation) -> None:
    if evaluation.tokens is not None and evaluation.tokens < EVAL_TOKENS_LEAST:
        raise OptionError(
            f"{named('evaluation.tokens', evaluation.tokens)} must be at least {EVAL_TOKENS_LEAST} (or null: all)"
        )


IMAGE_SOURCES = ("builtin:shapes", "builtin:stripes", "hf:")


def refuse_unused_calibration(passes: list[tuple[str, Any]], evaluating: bool, given: Any, source: str) -> None:
    """Refuse calibration settings the caller gave (``given``: Calibration's field names) that nothing reads: plain
    RTN quantisation reads no calibration, the window length serves calibration and evaluation, the image size
    only image sources."""
    from .preflight import _calibrates

    calibrated = any(_calibrates(name, config) for name, config in passes)
    images = any(piece.strip().startswith(IMAGE_SOURCES) for piece in source.split(","))
    for key in sorted(given):
        if key == "seq_len" and not (calibrated or evaluating):
            where = "calibration or an evaluation"
        elif key == "image_size" and not (calibrated and images):
            where = "an image calibration source (builtin:shapes, builtin:stripes, hf:NAME with images)"
        elif key not in ("seq_len", "image_size") and not calibrated:
            where = "a pass that calibrates (rtn quantisation without salient weights or adapters reads none)"
        else:
            continue
        raise OptionError(f"{named('calibration.' + key)} applies only with {where}; it would be ignored here")


def parse_recipe(document: Any, source: str = "recipe") -> Recipe:
    """A validated :class:`Recipe` from a parsed YAML document. Options are named by their key paths in messages
    (``passes[1].quantize.lowrank_budget``); a key given where the pass's other keys leave it unused is refused."""
    if not isinstance(document, dict):
        raise UserInputError(f"{source}: a recipe is a mapping with model, calibration and passes")
    unknown = sorted(set(document) - {"model", "calibration", "passes", "device"}, key=str)
    if unknown:
        raise UserInputError(f"{_short(unknown[0])}: unknown key; a recipe takes model, calibration, passes, device")
    device = document.get("device")
    if device is not None:
        from ..device import parse_device

        if not isinstance(device, str):
            raise UserInputError(f"device: expected {DEVICE_CHOICES}, got {_short(device)}")
        parse_device(device, "device")
    model = document.get("model")
    if model is not None and not isinstance(model, str):
        raise UserInputError(f"model: expected a model directory, builtin:NAME or a hub id, got {_short(model)}")
    common: dict[Any, str] = {"calibration": "calibration"}
    keys = RecipeKeys(common, [])
    try:
        calibration = _dataclass(Calibration, document.get("calibration"), "calibration")
        _check_calibration(calibration)
    except OptionError as error:
        raise keys.bind(error) from None
    steps = document.get("passes")
    if not isinstance(steps, list) or not steps:
        raise UserInputError("passes: expected a non-empty list of passes")
    recipe = Recipe(model, calibration, device=device, vocabulary=keys)
    given: list[set[str]] = []
    for index in range(len(steps)):
        try:
            _parse_step(recipe, steps, index, given)
        except OptionError as error:
            raise keys.bind(error, max(len(keys.passes) - 1, 0)) from None
    if not recipe.passes:
        raise UserInputError("passes: the recipe has no compressing pass (only eval)")
    given_calibration = document.get("calibration") or {}
    try:
        refuse_unused_calibration(recipe.passes, recipe.evaluation is not None, given_calibration, calibration.source)
    except OptionError as error:
        raise keys.bind(error) from None
    return recipe


def _parse_step(recipe: Recipe, steps: list[Any], index: int, given: list[set[str]]) -> None:
    """Step ``index`` of the document's passes into ``recipe``; ``given`` holds each compressing pass's keys."""
    keys: RecipeKeys = recipe.vocabulary
    step = steps[index]
    where = f"passes[{index}]"
    if not isinstance(step, dict) or len(step) != 1:
        raise UserInputError(f"{where}: each pass is a mapping with one key, the pass name")
    ((name, params),) = step.items()
    path = f"{where}.{name}"
    if name not in pass_names():
        raise UserInputError(f"{where}.{_short(name)}: unknown pass; choose from {', '.join(pass_names())}")
    if recipe.evaluation is not None:
        raise UserInputError(f"{path}: eval must be the last pass")
    if name == "eval":
        keys.sections["evaluation"] = path
        recipe.evaluation = _dataclass(Evaluation, params, path)
        _check_evaluation(recipe.evaluation)
        return
    if name == "lowrank":
        previous = recipe.passes[-1] if recipe.passes else None
        takes_lowrank = previous is not None and isinstance(previous[1], QuantizeConfig)
        if not takes_lowrank or index == 0 or "lowrank" in steps[index - 1]:
            raise UserInputError(f"{path}: lowrank must directly follow a quantize pass")
        params = params or {}
        if not isinstance(params, dict) or sorted(set(params) - set(LOWRANK_KEYS), key=str):
            extra = sorted(set(params) - set(LOWRANK_KEYS), key=str) if isinstance(params, dict) else ["(a list)"]
            raise UserInputError(f"{path}.{_short(extra[0])}: unknown key; lowrank takes {', '.join(LOWRANK_KEYS)}")
        keys.passes[-1].update({(QuantizeConfig, key): f"{path}.{key}" for key in params})
        merged = {**dataclasses.asdict(previous[1]), **params}
        config = _dataclass(QuantizeConfig, merged, path)
        _validated(config, path)
        given[-1] |= set(params)
        refuse_unused(config, given[-1])
        recipe.passes[-1] = (previous[0], config)
        return
    entry = PASSES[name]
    quantizing = {other for other, known in PASSES.items() if known.quantizes}
    quantized_at = next(
        (f"passes[{i}].{next(iter(s))}" for i, s in enumerate(steps[:index]) if set(s) & quantizing), None
    )
    if entry.prunes and quantized_at:
        raise UserInputError(f"{path}: pruning must come before quantisation ({quantized_at})")
    if entry.quantizes and quantized_at:
        raise UserInputError(f"{path}: the model is already quantised by {quantized_at}")
    nested = nested_configs(entry.config)
    sections: dict[Any, str] = {entry.config: path, **{inner: f"{path}.{key}" for key, inner in nested.items()}}
    keys.passes.append(sections)
    config = _dataclass(entry.config, params, path)
    if "seed" not in (params or {}) and any(f.name == "seed" for f in dataclasses.fields(config)):
        config = dataclasses.replace(config, seed=recipe.calibration.seed)
    _validated(config, path)
    params = params or {}
    given.append(set(params))
    refuse_unused(config, params, {key: set(params[key]) for key in nested if isinstance(params.get(key), dict)})
    recipe.passes.append((name, config))


MAX_RECIPE_BYTES = 1 << 20
"""A recipe is a page of YAML; a file larger than this was named by mistake (a checkpoint, a log)."""


def read_recipe_text(path: Path) -> str:
    """The recipe file's text: a regular file of at most :data:`MAX_RECIPE_BYTES`, UTF-8, without NUL bytes."""
    try:
        if Path(path).is_dir():
            raise UserInputError(f"{path}: a directory, not a recipe file")
        size = Path(path).stat().st_size
        if size > MAX_RECIPE_BYTES:
            raise UserInputError(f"{path}: {size} bytes, not a recipe (a recipe is YAML text of at most 1 MB)")
        data = Path(path).read_bytes()
    except OSError as error:
        raise UserInputError(f"{path}: cannot read the recipe ({error.strerror})") from None
    nul = data.find(b"\0")
    if nul >= 0:
        raise UserInputError(f"{path}: a binary file (NUL byte at offset {nul}), not a YAML recipe")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise UserInputError(
            f"{path}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); save the recipe as UTF-8"
        ) from None


def load_recipe(path: Path) -> Recipe:
    try:
        document = recipe_yaml.load(read_recipe_text(path))
    except recipe_yaml.RecipeYAMLError as error:
        raise UserInputError(f"{path}: {error}") from None
    except yaml.YAMLError as error:
        raise UserInputError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from None
    return parse_recipe(document, str(path))


def describe(recipe: Recipe) -> list[str]:
    """One line per pass: its headline parameters (:attr:`~moecompress.passes.base.PassEntry.headline`) and every
    other parameter that differs from the default."""
    lines = []
    for name, config in recipe.passes:
        defaults = type(config)()
        headline = PASSES[name].headline
        shown = {
            f.name: getattr(config, f.name)
            for f in dataclasses.fields(config)
            if (f.name in headline and getattr(config, f.name) is not None)
            or getattr(config, f.name) != getattr(defaults, f.name)
        }
        lines.append(f"{name}: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    if recipe.evaluation is not None:
        lines.append(f"eval: data={recipe.evaluation.data}, tokens={recipe.evaluation.tokens}")
    return lines


def check_recipe(recipe: Recipe, model_dir: Path) -> None:
    """Refuse, before any work, what the recipe's options and the input's config alone decide is impossible."""
    from .preflight import check_passes

    evaluation = recipe.evaluation
    check_passes(
        model_dir,
        recipe.passes,
        calib_source=recipe.calibration.source,
        calib_tokens=recipe.calibration.tokens,
        seq_len=recipe.calibration.seq_len,
        eval_data=None if evaluation is None else evaluation.data,
        eval_tokens=None if evaluation is None else evaluation.tokens,
        name_passes=len(recipe.passes) > 1 or recipe.evaluation is not None,
        vocabulary=recipe.vocabulary,
    )


def recipe_digest(recipe: Recipe, model_dir: Path) -> str:
    """What a resumed run must share with the run it continues: the model and every parameter."""
    described = {
        "model": str(Path(model_dir).absolute()),
        "calibration": dataclasses.asdict(recipe.calibration),
        "passes": [[name, dataclasses.asdict(config)] for name, config in recipe.passes],
        "evaluation": None if recipe.evaluation is None else dataclasses.asdict(recipe.evaluation),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()


def _tree_hashes(directory: Path) -> dict[str, str]:
    return {path.name: file_sha256(path) for path in sorted(directory.iterdir()) if path.is_file()}


class RunState:
    """A recipe run's hidden sibling ``.OUT.run``: one directory per pass (``step-i``), the writers' work
    directories of the pass under way, and ``manifest.json`` naming the finished passes with their files' hashes.
    The output directory appears only when every pass and the evaluation are done."""

    def __init__(self, out_dir: Path, digest: str, resume: bool):
        self.directory = self.directory_of(out_dir)
        self.manifest_path = self.directory / "manifest.json"
        self.digest = digest
        self.finished: dict[int, dict[str, str]] = {}
        self._reports: dict[int, dict[str, Any]] = {}
        manifest = self._read_manifest() if resume else None
        if manifest is not None and manifest.get("recipe") != digest:
            raise OptionError(
                f"{self.directory}: the interrupted run used another recipe or model; "
                f"discard it with {named('run.restart', True)} to start over"
            )
        if manifest is None:
            if self.directory.exists():
                shutil.rmtree(self.directory)
            self.directory.mkdir(parents=True)
            write_text(self.directory / INCOMPLETE_MARKER, "moecompress is still running this recipe\n")
            self._write_manifest()
        else:
            check_resume_threads(manifest.get("threads"), self.directory)
            self.finished = {int(index): hashes for index, hashes in manifest.get("finished", {}).items()}
            self._reports = {int(index): report for index, report in manifest.get("reports", {}).items()}

    @staticmethod
    def directory_of(out_dir: Path) -> Path:
        return hidden_dir(out_dir, "run")

    def _read_manifest(self) -> dict[str, Any] | None:
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return manifest if isinstance(manifest, dict) else None

    def _write_manifest(self) -> None:
        finished = {str(index): hashes for index, hashes in sorted(self.finished.items())}
        reports = {str(index): report for index, report in sorted(self._reports.items())}
        manifest = {"recipe": self.digest, "threads": thread_count(), "finished": finished, "reports": reports}
        write_json(self.manifest_path, manifest, indent=None)

    def step(self, index: int) -> Path:
        return self.step_of(self.directory, index)

    @staticmethod
    def step_of(directory: Path, index: int) -> Path:
        return directory / f"step-{index}"

    def last_intact_step(self) -> int | None:
        """The latest finished pass whose directory still has exactly the recorded bytes."""
        for index in sorted(self.finished, reverse=True):
            step = self.step(index)
            if step.is_dir() and _tree_hashes(step) == self.finished[index]:
                return index
        return None

    def reports(self, before: int) -> list[dict[str, Any]]:
        """The reports of the finished passes with an index below ``before``, in order."""
        return [self._reports[index] for index in sorted(self._reports) if index < before]

    def mark_finished(self, index: int, report: dict[str, Any]) -> None:
        self.finished = {i: h for i, h in self.finished.items() if i < index}
        self._reports = {i: r for i, r in self._reports.items() if i < index}
        self.finished[index] = _tree_hashes(self.step(index))
        self._reports[index] = report
        self._write_manifest()
        for earlier in range(index):
            shutil.rmtree(self.step(earlier), ignore_errors=True)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _versions() -> dict[str, str]:
    import torch
    import transformers

    from .. import __version__

    return {"moecompress": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def run_recipe(
    recipe: Recipe,
    model_dir: Path,
    out_dir: Path,
    *,
    overwrite: bool = False,
    progress: bool = True,
    resume: bool = False,
    chained: bool = False,
) -> dict[str, Any]:
    """Run the passes in order, then the evaluation; returns the last pass's report with the recipe, the earlier
    passes' reports, the evaluation and the outcome (the summary table's figures) added.

    Consecutive layer passes run as one pipeline (:mod:`moecompress.runner.pipeline`: shared sweeps, the output written
    once); a whole-model pass runs on the previous stage's output, kept in the run's hidden directory. With
    ``chained`` every pass is its own stage writing a whole checkpoint, as recipes ran before the pipeline (kept for
    the comparison in docs/pipeline.md). The output directory appears, in one rename, only at the very end. With
    ``resume`` a run that was killed continues: finished stages whose files are intact are skipped, the stage under
    way continues from its last finished layer, and the output is byte-identical to an uninterrupted run.

    Under ``torchrun`` (``WORLD_SIZE`` above 1) a recipe of one ``prune_experts`` pass shares its calibration over
    the ranks: rank 0 alone creates the run directory and the output and evaluates, the others take part in the
    measuring sweep, wait for rank 0 and return the same report. The output is that of a single-process run.
    """
    from ..device import using_device

    try:
        model_dir, out_dir = Path(model_dir), Path(out_dir).absolute()
        check_output_is_not_input(model_dir, out_dir)
        distributed.init_from_environment()
        _check_ranks(recipe, resume)
        check_recipe(recipe, model_dir)
        _check_imatrix_outside(recipe, out_dir)
        with using_device(distributed.rank_device(recipe.device)):
            return _run_recipe(
                recipe, model_dir, out_dir, overwrite=overwrite, progress=progress, resume=resume, chained=chained
            )
    except OptionError as error:
        raise _spelled(recipe, error) from None
    finally:
        end_of_command()


def _check_imatrix_outside(recipe: Recipe, out_dir: Path) -> None:
    from ..export.imatrix import check_outside_output

    for _, config in recipe.passes:
        for part in (config, *(getattr(config, key) for key in nested_configs(type(config)))):
            if isinstance(part, QuantizeConfig) and part.imatrix_out is not None:
                check_outside_output(Path(part.imatrix_out), out_dir, QuantizeConfig)


def _spelled(recipe: Recipe, error: OptionError) -> OptionError:
    """An error found while running, spelled as the recipe's caller spells options (unless already spelled): the
    pass it names is the one whose config owns the option (the only one, for a one-pass recipe)."""
    if recipe.vocabulary is None or error.vocabulary is not None:
        return error
    owners = [{type(config), *nested_configs(type(config)).values()} for _, config in recipe.passes]
    index = next((i for i, own in enumerate(owners) if error.owner in own), 0 if len(owners) == 1 else None)
    return recipe.vocabulary.bind(error, index)


def _check_ranks(recipe: Recipe, resume: bool) -> None:
    """What a run over several ranks cannot do, refused before the model is read."""
    ranks = distributed.world_size()
    if ranks > 1 and resume:
        raise OptionError(
            f"{named('run.resume', True)} needs a single process, not {ranks} ranks; run it without torchrun"
        )
    if ranks > 1 and not (len(recipe.passes) == 1 and PASSES[recipe.passes[0][0]].shares_ranks):
        shared = " or ".join(name for name, entry in PASSES.items() if entry.shares_ranks)
        raise UserInputError(
            f"with {ranks} ranks a recipe can only be one {shared} pass (the one whose calibration is shared); "
            "run the others in a single process"
        )


def _run_recipe(
    recipe: Recipe, model_dir: Path, out_dir: Path, *, overwrite: bool, progress: bool, resume: bool, chained: bool
) -> dict[str, Any]:
    from .pipeline import run_layer_passes

    ranks = distributed.world_size()
    state = distributed.on_writer(lambda: _start_run(recipe, model_dir, out_dir, overwrite, resume), share=False)
    if not distributed.is_writer():
        target = RunState.step_of(RunState.directory_of(out_dir), 0)
        run_layer_passes(model_dir, target, recipe.passes, recipe.calibration, overwrite=True, progress=progress)
        return distributed.on_writer(lambda: None)
    options = dict(progress=progress, resume=resume, chained=chained or ranks > 1)
    return distributed.on_writer(lambda: _run_passes(recipe, model_dir, out_dir, state, **options))


def _start_run(recipe: Recipe, model_dir: Path, out_dir: Path, overwrite: bool, resume: bool) -> RunState:
    from .preflight import check_not_replacing_inputs, check_replaceable, data_paths

    if out_dir.exists() and not overwrite:
        raise output_exists(out_dir)
    if out_dir.exists() or out_dir.is_symlink():
        check_replaceable(out_dir)
        evaluated = data_paths(recipe.evaluation.data) if recipe.evaluation is not None else []
        check_not_replacing_inputs(out_dir, [*data_paths(recipe.calibration.source), *evaluated])
    try:
        return RunState(out_dir, recipe_digest(recipe, model_dir), resume)
    except DiskFullError as error:
        raise error.writing(str(out_dir)) from error


def _run_passes(
    recipe: Recipe,
    model_dir: Path,
    out_dir: Path,
    state: RunState,
    *,
    progress: bool,
    resume: bool,
    chained: bool = False,
) -> dict[str, Any]:
    from ..evals.perplexity import evaluate
    from ..output_report import update_report
    from .pipeline import plan_stages, run_layer_passes, run_whole_model_pass
    from .summary import attribute_to_input, load_report, measure_outcome

    calib = recipe.calibration
    stages = plan_stages(recipe.passes, chained=chained)
    total = len(stages)
    done = state.last_intact_step() if resume else None
    source = model_dir if done is None else state.step(done)
    if done is not None:
        event("resume", f"resuming after stage {done + 1}/{total} ({stages[done].name}), already finished")
    reports = [r for stage in state.reports(before=total - 1) for r in [*stage.pop("previous_passes", []), stage]]
    try:
        for index in range(0 if done is None else done + 1, total):
            stage = stages[index]
            target = state.step(index)
            started = time.monotonic()
            for pass_name in stage.names:
                event(
                    "pass",
                    f"pass {index + 1}/{total}: {pass_name} started",
                    index=index,
                    name=pass_name,
                    state="start",
                    starting=True,
                )
            if stage.kind == "layer":
                report = run_layer_passes(
                    source, target, stage.passes, calib, overwrite=True, progress=progress, resume=resume
                )
            else:
                report = run_whole_model_pass(
                    source, target, stage.passes[-1], calib, overwrite=True, progress=progress
                )
            seconds = time.monotonic() - started
            for pass_name in stage.names:
                event(
                    "pass",
                    f"pass {index + 1}/{total}: {pass_name} done in {seconds:.1f}s",
                    index=index,
                    name=pass_name,
                    state="end",
                    seconds=round(seconds, 2),
                )
            if index < total - 1 or recipe.evaluation is not None:
                # The last pass's hashes serve only a resume of the evaluation; without one, hashing the whole
                # output again would cost a read of it (BENCHMARKS.md) for nothing.
                state.mark_finished(index, report)
            if index < total - 1:
                reports.extend([*report.get("previous_passes", []), report])
                report.pop("previous_passes", None)
            source = target
        final = state.step(total - 1)
        report = load_report(final)
        inner = report.pop("previous_passes", None) or []
        report["recipe"] = {"model": str(model_dir), "passes": describe(recipe)}
        report["previous_passes"] = [*reports, *inner]
        evaluation = None
        if recipe.evaluation is not None:
            event("eval", f"evaluating on {recipe.evaluation.data}", state="start", starting=True)
            result = evaluate(
                final,
                recipe.evaluation.data,
                seq_len=calib.seq_len,
                max_tokens=recipe.evaluation.tokens,
                reference_dir=model_dir,
                progress=progress,
            )
            evaluation = {"data": recipe.evaluation.data, **result.to_json()}
            report["eval"] = evaluation
        report["outcome"] = measure_outcome(model_dir, final, evaluation)
        attribute_to_input(report, model_dir)
        report["versions"] = _versions()
        report["threads"] = thread_count()
        update_report(final, report)
        _move_into_place(final, out_dir)
    except UserInputError:
        state.remove()
        raise
    except DiskFullError as error:
        raise error.writing(str(out_dir)) from error
    except OSError as error:
        if is_full(error):
            raise DiskFullError(str(out_dir), error.errno) from error
        state.remove()
        raise
    state.remove()
    return report


def _move_into_place(final: Path, out_dir: Path) -> None:
    if out_dir.exists():
        backup = hidden_dir(out_dir, "replaced")
        os.replace(out_dir, backup)
        os.replace(final, out_dir)
        shutil.rmtree(backup)
    else:
        os.replace(final, out_dir)
