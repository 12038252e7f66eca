"""The Python API: :func:`prune`, :func:`quantize`, :func:`run` and :func:`evaluate`, re-exported from
``moecompress``.

Each call does what the command of the same name does: the compressing calls build the one-pass recipe the CLI
builds and run it through :func:`moecompress.runner.recipes.run_recipe`, so options, validation, resume and the
output are the CLI's. Options are the fields of the pass's config dataclass (:class:`~moecompress.passes.prune_experts.
PruneExpertsConfig`, :class:`~moecompress.passes.quantize.QuantizeConfig`), calibration and evaluation those of
:class:`~moecompress.runner.recipes.Calibration` and :class:`~moecompress.runner.recipes.Evaluation`; every name and
value is checked before any work. Results are typed (:class:`PruneResult`, :class:`QuantizeResult`, :class:`RunResult`,
:class:`~moecompress.evals.perplexity.EvalResult`). Progress output is off unless ``progress=True``.

Heavy modules (torch, transformers) are imported inside the calls, so ``import moecompress`` stays light.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .defaults import CALIBRATION_LEAST, DEFAULT_EVAL_DATA, DEFAULT_EVAL_TOKENS, DEFAULT_SEQ_LEN

if TYPE_CHECKING:
    from .evals.perplexity import EvalResult
    from .passes.prune_experts import PruneExpertsConfig
    from .passes.quantize import QuantizeConfig
    from .runner.recipes import Recipe

_DEFAULT = object()
"""``evaluation`` left out: the recipes' default evaluation (the CLI's, without ``--no-eval``)."""


@dataclass(frozen=True)
class CompressResult:
    """What a compressing call changed, input against output (the CLI's summary table), and where it wrote."""

    out: Path
    experts_before: int
    experts_after: int
    query_heads_before: int
    query_heads_after: int
    kv_heads_before: int
    kv_heads_after: int
    bytes_before: int
    """Weight bytes of the input, every scale, zero point and adapter included."""
    bytes_after: int
    bits_per_weight_before: float
    bits_per_weight_after: float
    """Over every parameter of the model, scales and metadata included."""
    expert_bits_per_weight_before: float
    expert_bits_per_weight_after: float
    evaluation: EvalResult | None
    """The output against the input (perplexity of both, KL, routing agreement); None when not evaluated. Its
    ``tokens_per_second`` is NaN: the report keeps no wall-clock figures."""
    report: dict[str, Any] = field(repr=False)
    """The output's ``moecompress_report.json``, for everything else."""


@dataclass(frozen=True)
class PruneResult(CompressResult):
    config: PruneExpertsConfig
    kept: dict[int, tuple[int, ...]]
    """Per MoE layer, the original ids of the experts kept, in their new order."""
    removed: dict[int, tuple[int, ...]]
    uniform: bool
    """Every layer keeps the same count (loads in every stock tool); otherwise load after ``import moecompress``."""


@dataclass(frozen=True)
class QuantizeResult(CompressResult):
    config: QuantizeConfig
    scheme: str
    """The scheme as the report describes it, e.g. ``mxfp4 (scale rule floor)``."""
    quantized_modules: int
    rtn_fallback_experts: dict[int, tuple[int, ...]]
    """GPTQ: per layer, the experts routed too few calibration tokens, quantised round-to-nearest instead."""
    lowrank_components: int | None
    """Rank-1 adapter components spent over all expert matrices; None without low-rank adapters."""


@dataclass(frozen=True)
class RunResult(CompressResult):
    passes: tuple[str, ...]
    """One line per pass with the parameters that differ from their defaults (as ``run --dry-run`` prints)."""


def prune(
    model: str | Path,
    out: str | Path,
    *,
    calibration: Mapping[str, Any] | None = None,
    evaluation: Mapping[str, Any] | None = _DEFAULT,  # type: ignore[assignment]
    overwrite: bool = False,
    resume: bool = False,
    restart: bool = False,
    progress: bool = False,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    device: str | None = None,
    **options: Any,
) -> PruneResult:
    """Remove routed experts from ``model`` (a directory, ``builtin:tiny-moe`` or a hub id) into ``out``.

    ``options`` are :class:`~moecompress.passes.prune_experts.PruneExpertsConfig`'s fields (``method``,
    ``ratio``, ``keep``, ``scope``, ...); giving ``keep`` alone prunes to that count (as ``--keep`` does).
    ``calibration`` takes :class:`~moecompress.runner.recipes.Calibration`'s fields (``source``, ``tokens``,
    ``seq_len``, ``seed``, ``image_size``), ``evaluation`` :class:`~moecompress.runner.recipes.Evaluation`'s (``data``,
    ``tokens``), or None to skip it. ``overwrite`` replaces an existing ``out``; an interrupted run's partial work
    is refused unless ``resume`` (continue it) or ``restart`` (discard it), as on the command line. ``device``
    (``auto``, the default: CUDA when torch sees one; ``cpu``, ``cuda``, ``cuda:N``) is where the layers compute.
    """
    recipe, model_dir = _one_pass("prune", "prune_experts", model, options, calibration, evaluation)
    report = _run(recipe, model_dir, out, overwrite, resume, restart, progress, trust_remote_code, allow_pickle, device)
    layers = report.get("layers", {})
    return PruneResult(
        **_common(report, out),
        config=recipe.passes[0][1],
        kept={int(layer): tuple(entry["kept"]) for layer, entry in layers.items()},
        removed={int(layer): tuple(entry["removed"]) for layer, entry in layers.items()},
        uniform=bool(report.get("uniform", True)),
    )


def quantize(
    model: str | Path,
    out: str | Path,
    *,
    calibration: Mapping[str, Any] | None = None,
    evaluation: Mapping[str, Any] | None = _DEFAULT,  # type: ignore[assignment]
    overwrite: bool = False,
    resume: bool = False,
    restart: bool = False,
    progress: bool = False,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    device: str | None = None,
    **options: Any,
) -> QuantizeResult:
    """Quantise ``model``'s routed experts (and ``targets``) into ``out``.

    ``options`` are :class:`~moecompress.passes.quantize.QuantizeConfig`'s fields (``scheme``, ``method``,
    ``group_size``, ``targets``, ``format``, ``lowrank_budget``, ...); ``calibration`` and ``evaluation`` as in
    :func:`prune` (calibration is used by gptq, salient weights and low-rank adapters only), ``device`` too.
    """
    recipe, model_dir = _one_pass("quantize", "quantize", model, options, calibration, evaluation)
    report = _run(recipe, model_dir, out, overwrite, resume, restart, progress, trust_remote_code, allow_pickle, device)
    lowrank = report.get("lowrank")
    return QuantizeResult(
        **_common(report, out),
        config=recipe.passes[0][1],
        scheme=str(report.get("scheme_description", recipe.passes[0][1].scheme)),
        quantized_modules=int(report.get("quantized_modules", 0)),
        rtn_fallback_experts={
            int(layer): tuple(experts) for layer, experts in report.get("rtn_fallback_experts", {}).items()
        },
        lowrank_components=None if not lowrank else int(lowrank["components_used"]),
    )


def run(
    recipe: str | Path | Mapping[str, Any] | Recipe,
    *,
    out: str | Path,
    model: str | Path | None = None,
    overwrite: bool = False,
    resume: bool = False,
    restart: bool = False,
    progress: bool = False,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    device: str | None = None,
) -> RunResult:
    """Run a recipe (a YAML file's path, the same document as a dict, or a parsed
    :class:`~moecompress.runner.recipes.Recipe`) into ``out``; ``model`` replaces the recipe's model (as
    ``run --model``), ``device`` the recipe's ``device:`` (as ``run --device``).
    """
    from .errors import UserInputError
    from .runner.recipes import Recipe, describe, load_recipe, parse_recipe
    from .vocabulary import Arguments, RecipeKeys

    if isinstance(recipe, Recipe):
        parsed = recipe
    elif isinstance(recipe, Mapping):
        parsed = parse_recipe(dict(recipe), "recipe")
    elif isinstance(recipe, (str, Path)):
        parsed = load_recipe(Path(recipe))
    else:
        raise TypeError(f"run() takes a recipe path, dict or Recipe, got {type(recipe).__name__}")
    name = str(model) if model is not None else parsed.model
    if name is None:
        raise UserInputError("run(): the recipe names no model; pass model=")
    keys = parsed.vocabulary
    invoked = keys.invoked_by(Arguments("run")) if isinstance(keys, RecipeKeys) else keys
    parsed = dataclasses.replace(parsed, model=name, vocabulary=invoked)
    model_dir = _resolve(name)
    report = _run(parsed, model_dir, out, overwrite, resume, restart, progress, trust_remote_code, allow_pickle, device)
    return RunResult(**_common(report, out), passes=tuple(describe(parsed)))


def evaluate(
    model: str | Path,
    reference: str | Path | None = None,
    *,
    data: str = DEFAULT_EVAL_DATA,
    seq_len: int = DEFAULT_SEQ_LEN,
    max_tokens: int | None = _DEFAULT,  # type: ignore[assignment]
    progress: bool = False,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    device: str | None = None,
) -> EvalResult:
    """Perplexity of ``model`` on ``data`` (built-in sources: their held-out part) over windows of ``seq_len``
    tokens, at most ``max_tokens`` of them (None: all; default 16384); with ``reference``, also KL(reference ‖
    model), the reference's perplexity and routing agreement. As ``moecompress eval``, with the same checks before
    any work.
    ``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``; default auto) is where the layers compute."""
    from .device import parse_device, using_device
    from .errors import OptionError
    from .evals.perplexity import evaluate as evaluate_dirs
    from .loading import load_adapter
    from .runner.preflight import check_data_spec, check_eval_window, check_seq_len
    from .vocabulary import Arguments, named

    arguments = Arguments(
        "evaluate",
        {("calibration", "seq_len"): "seq_len", ("evaluation", "tokens"): "max_tokens", ("evaluation", "data"): "data"},
    )
    given_tokens = max_tokens is not _DEFAULT
    if not given_tokens:
        max_tokens = DEFAULT_EVAL_TOKENS
    try:
        least = CALIBRATION_LEAST["seq_len"]
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < least:
            raise OptionError(f"{named('calibration.seq_len', repr(seq_len))} must be an integer of at least {least}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
            raise OptionError(f"{named('evaluation.tokens', repr(max_tokens))} must be an integer or None (all)")
        if not isinstance(data, str):
            raise OptionError(
                f"{named('evaluation.data')} must be a source name such as {DEFAULT_EVAL_DATA}, got {data!r}"
            )
        compute = parse_device(device, "evaluate(): device")
        with _trust(trust_remote_code, allow_pickle), _quiet(not progress), using_device(compute):
            model_dir = _resolve(model)
            reference_dir = None if reference is None else _resolve(reference)
            check_seq_len(load_adapter(model_dir), seq_len)
            check_eval_window(seq_len, max_tokens, given_tokens)
            check_data_spec(data, named("evaluation.data"))
            return evaluate_dirs(
                model_dir, data, seq_len=seq_len, max_tokens=max_tokens, reference_dir=reference_dir, progress=progress
            )
    except OptionError as error:
        raise arguments.bind(error) from None


def _one_pass(
    caller: str,
    pass_name: str,
    model: str | Path,
    options: dict[str, Any],
    calibration: Mapping[str, Any] | None,
    evaluation: Mapping[str, Any] | None,
) -> tuple[Recipe, Path]:
    """The one-pass recipe the CLI command builds, validated by the recipe parser (names, types, values), with
    error messages naming the API's argument instead of the recipe's key path."""
    from .errors import OptionError, UserInputError
    from .passes.registry import PASSES
    from .runner.recipes import parse_recipe
    from .vocabulary import Arguments

    names = [f.name for f in dataclasses.fields(PASSES[pass_name].config)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise TypeError(f"{caller}() got an unknown option {unknown[0]!r}; it takes {', '.join(names)}")
    calibration = dict(_mapping("calibration", calibration or {}))
    if "seed" in options and "seed" not in calibration:
        calibration["seed"] = options["seed"]
    passes: list[dict[str, Any]] = [{pass_name: dict(options)}]
    if evaluation is _DEFAULT:
        passes.append({"eval": {}})
    elif evaluation is not None:
        passes.append({"eval": dict(_mapping("evaluation", evaluation))})
    document = {"model": str(model), "calibration": calibration, "passes": passes}
    arguments = Arguments(caller)
    try:
        recipe = parse_recipe(document, caller)
    except OptionError as error:
        raise arguments.bind(error) from None
    except UserInputError as error:
        message = str(error)
        for path, argument in (
            (f"passes[0].{pass_name}.", ""),
            (f"passes[0].{pass_name}: ", ""),
            ("passes[1].eval", "evaluation"),
        ):
            message = message.replace(path, argument)
        raise UserInputError(f"{caller}(): {message}") from None
    return dataclasses.replace(recipe, vocabulary=arguments), _resolve(model)


def _mapping(argument: str, value: Any) -> Mapping[str, Any]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise TypeError(f"{argument}= takes a dict of its fields (or None), got {type(value).__name__}")
    return value


def _resolve(model: str | Path) -> Path:
    from .checkpoint import resolve_model

    return resolve_model(str(model))


@contextlib.contextmanager
def _quiet(silent: bool) -> Iterator[None]:
    """``progress=False``: no moecompress progress and no transformers load bars or warnings inside the call; the
    caller's settings are restored afterwards. Either way the call ends as a command does
    (:func:`~moecompress.progress.end_of_command`)."""
    from transformers.utils import logging as hf_logging

    from .progress import end_of_command, silenced

    if not silent:
        try:
            yield
        finally:
            end_of_command()
        return
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with silenced():
            yield
    finally:
        end_of_command()
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _trust(remote_code: bool, pickle: bool) -> Iterator[None]:
    from .trust import trusting

    with trusting(remote_code=remote_code, pickle=pickle):
        yield


def _run(
    recipe: Recipe,
    model_dir: Path,
    out: str | Path,
    overwrite: bool,
    resume: bool,
    restart: bool,
    progress: bool,
    trust_remote_code: bool,
    allow_pickle: bool,
    device: str | None = None,
) -> dict[str, Any]:
    """The recipe run as the commands run it (:func:`moecompress.cli.run_options.run_and_summarise`, which also
    prints): the recipe and the output checked before any work, then :func:`~moecompress.runner.recipes.run_recipe`.
    ``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``) overrides the recipe's ``device:``."""
    from .device import parse_device
    from .errors import OptionError
    from .runner import lock as run_lock
    from .runner.preflight import check_output, discard_partial_work
    from .runner.recipes import check_recipe, run_recipe

    if device is not None:
        parse_device(device, "device")
        recipe = dataclasses.replace(recipe, device=str(device))
    out_dir = Path(out).absolute()
    with _trust(trust_remote_code, allow_pickle), _quiet(not progress), run_lock.releasing(out_dir):
        try:
            check_output(out_dir, model_dir, overwrite=overwrite, resume=resume, restart=restart, discard=False)
        except OptionError as error:
            raise (error if recipe.vocabulary is None else recipe.vocabulary.bind(error)) from None
        check_recipe(recipe, model_dir)
        if restart:
            discard_partial_work(out_dir)
        return run_recipe(recipe, model_dir, out_dir, overwrite=overwrite, resume=resume, progress=progress)


def _common(report: dict[str, Any], out: str | Path) -> dict[str, Any]:
    outcome = report["outcome"]
    figures = {}
    for key in ("experts", "query_heads", "kv_heads", "bytes", "bits_per_weight", "expert_bits_per_weight"):
        figures[f"{key}_before"], figures[f"{key}_after"] = outcome[key]
    evaluation = report.get("eval")
    return {
        "out": Path(out).absolute(),
        **figures,
        "evaluation": None if evaluation is None else _eval_result(evaluation),
        "report": report,
    }


def _eval_result(figures: dict[str, Any]) -> EvalResult:
    from .evals.perplexity import EvalResult

    names = {f.name for f in dataclasses.fields(EvalResult)}
    values = {key: value for key, value in figures.items() if key in names}
    values.setdefault("tokens_per_second", float("nan"))
    return EvalResult(**values)
