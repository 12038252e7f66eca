"""Checks of everything a recipe's options and the input's config alone decide, made before any work.

A run that would fail on an impossible expert count, a window longer than the model's positions or a missing data
file fails here, in a second, instead of after the calibration sweep. Nothing is written and nothing heavier than
config.json and the safetensors headers is read.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..calibration.builtin_corpus import BUILTIN_NAMES
from ..calibration.sources import PARTS, check_data_files, parse_hf_spec
from ..checkpoint.writer import INCOMPLETE_MARKER
from ..defaults import DEFAULT_EVAL_TOKENS
from ..errors import OptionError, UserInputError
from ..vocabulary import named

RESTART_HINT = f"continue it with {named('run.resume', True)}, or discard it with {named('run.restart', True)}"


def _with_value(option: str, value: Any) -> str:
    """``option`` (a literal such as ``--eval-data``, or a :func:`~moecompress.vocabulary.named` placeholder)
    with ``value``."""
    if option.startswith("{") and option.endswith("}"):
        return named(option[1:-1], value)
    return f"{option} {value}"


def check_data_spec(spec: str, option: str) -> None:
    """Every comma-separated piece of ``spec`` names a built-in part, an hf: dataset, an image source or an
    existing path (the files themselves are read later). ``option`` names the option that gave it."""
    pieces = [piece.strip() for piece in spec.split(",") if piece.strip()]
    if not pieces:
        raise OptionError(f"{option}: empty data source")
    for piece in pieces:
        if piece.startswith("builtin:"):
            parts = piece.split(":")
            if parts[1] in ("shapes", "stripes"):
                continue
            if parts[1] not in BUILTIN_NAMES or len(parts) > 3 or (len(parts) == 3 and parts[2] not in PARTS):
                raise OptionError(
                    f"{_with_value(option, piece)}: unknown built-in source; use builtin:"
                    f"({'|'.join(BUILTIN_NAMES)})[:({'|'.join(PARTS)})]"
                )
        elif piece.startswith("hf:"):
            parse_hf_spec(piece)
        elif not Path(piece).expanduser().exists():
            raise OptionError(f"{_with_value(option, piece)}: no such data file, and not builtin:NAME or hf:NAME")
        else:
            check_data_files(Path(piece).expanduser())


def check_seq_len(adapter: Any, seq_len: int, option: str = "{calibration.seq_len}", owner: Any = None) -> None:
    limit = adapter.text_config.get("max_position_embeddings")
    if isinstance(limit, int) and seq_len > limit:
        raise OptionError(
            f"{_with_value(option, seq_len)} exceeds the model's max_position_embeddings ({limit})", owner
        )


def check_eval_window(seq_len: int, tokens: int | None, given: bool = True) -> None:
    """At least one window is evaluated. Where the token count was left at its default (``given`` False), the
    message names the window length, the one the caller set."""
    if tokens is None or tokens >= seq_len:
        return
    window = named("calibration.seq_len", seq_len)
    if given:
        raise OptionError(f"{named('evaluation.tokens', tokens)} is less than one window of {window}")
    raise OptionError(
        f"{window} is longer than the {tokens} tokens evaluated by default; give {named('evaluation.tokens')} of at "
        "least one window"
    )


def _quantized_method(adapter: Any) -> str | None:
    for section in (adapter.config, adapter.text_config):
        method = (section.get("quantization_config") or {}).get("quant_method")
        if method:
            return str(method)
    return None


def check_router_sizes(model_dir: Path, adapter: Any) -> None:
    """Each MoE layer's router, as its safetensors header says, has one row per expert config.json promises; the
    counts below are decided from config.json, so a disagreement is named first (the reader names it again on
    reading the layer)."""
    from ..checkpoint import CheckpointReader

    with CheckpointReader(model_dir, decode=False) as reader:
        for layer in adapter.moe_layers():
            key = adapter._router_key(layer, "weight")
            info = reader.tensors.get(key)
            promised = adapter.stored_router_columns(layer)
            rows = info.shape[-1 if adapter.router_transposed else 0] if info is not None and info.shape else None
            if rows is not None and rows != promised:
                raise UserInputError(f"layer {layer} ({key}): config.json says {promised} experts, weights hold {rows}")


def check_prune_counts(adapter: Any, config: Any) -> None:
    """The selection of :func:`~moecompress.passes.prune_experts.choose_removals` run on placeholder scores: every
    count it refuses (more kept than there are experts, fewer than top-k, uneven splits, group limits) depends
    on the config and the layer sizes only, so it is refused here before the scores are measured."""
    from ..passes.prune_experts import LayerScores, choose_removals, group_limit

    layers = adapter.moe_layers()
    sizes = {layer: adapter.experts_in_layer(layer) for layer in layers}
    if config.keep is not None:
        largest = max(sizes.values())
        if config.keep >= largest:
            raise OptionError(
                f"{named('keep', config.keep)}: the model has {largest} experts per layer; keep fewer", type(config)
            )
        if config.keep < adapter.top_k:
            raise OptionError(
                f"{named('keep', config.keep)} is fewer than the minimum {adapter.top_k} (the model's top-k experts "
                "per token)",
                type(config),
            )
    if config.min_keep is not None and config.min_keep > min(sizes.values()):
        raise OptionError(
            f"{named('min_keep', config.min_keep)}: the model has only {min(sizes.values())} experts in some layer",
            type(config),
        )
    placeholders = []
    for layer, count in sizes.items():
        zeros = torch.zeros(count, device="cpu")
        placeholders.append(LayerScores(layer, list(range(count)), zeros, zeros, zeros, zeros))
    choose_removals(placeholders, config, adapter.top_k, group_limit(adapter))


def check_prune_heads(adapter: Any, config: Any, model_dir: Path) -> None:
    from ..heads.selection import removal_counts
    from ..passes.prune_heads import _check_input, head_layouts

    layouts = head_layouts(adapter, config.unit)
    _check_input(adapter, layouts, model_dir, config.unit)
    if config.scope == "layer":
        try:
            removal_counts(layouts, config.ratio)
        except OptionError as error:
            error.owner = error.owner or type(config)
            raise
    else:
        total = sum(layout.units for layout in layouts)
        remove = round(config.ratio * total)
        if remove == 0:
            raise OptionError(f"{named('ratio', config.ratio)} of {total} KV groups removes none", type(config))
        if remove > total - len(layouts):
            raise OptionError(f"{named('ratio', config.ratio)} would remove every KV group of some layer", type(config))


def check_passes(
    model_dir: Path,
    passes: list[tuple[str, Any]],
    *,
    calib_source: str | None,
    calib_tokens: int,
    seq_len: int,
    eval_data: str | None = None,
    eval_tokens: int | None = None,
    name_passes: bool = False,
    vocabulary: Any = None,
) -> None:
    """Refuse, before any work, what the passes' configs and the input's config.json decide is impossible
    (``name_passes``: a recipe's errors say which pass; ``vocabulary``: how the caller spells options)."""
    try:
        _check_passes(
            model_dir, passes, calib_source, calib_tokens, seq_len, eval_data, eval_tokens, name_passes, vocabulary
        )
    except OptionError as error:
        if vocabulary is not None:
            vocabulary.bind(error, getattr(error, "pass_index", None))
        raise


def _check_passes(
    model_dir: Path,
    passes: list[tuple[str, Any]],
    calib_source: str | None,
    calib_tokens: int,
    seq_len: int,
    eval_data: str | None,
    eval_tokens: int | None,
    name_passes: bool,
    vocabulary: Any,
) -> None:
    from dataclasses import replace

    from ..checkpoint.stock_model import check_stock_model_builds
    from ..loading import check_tokenizer_files, load_adapter
    from ..passes.base import InputFacts
    from ..passes.registry import PASSES

    adapter = load_adapter(model_dir)
    facts = InputFacts(model_dir, adapter, _quantized_method(adapter))
    for index, (name, config) in enumerate(passes):
        try:
            _check_pass(config, facts)
        except OptionError as error:
            error.pass_index = index
            if vocabulary is None and name_passes:
                error.template = f"pass {index + 1} ({name}): {error.template}"
            raise
        except UserInputError as error:
            if not name_passes:
                raise
            raise UserInputError(f"pass {index + 1} ({name}): {error}") from None
        if PASSES[name].removes_experts:
            facts = replace(facts, experts_removed=True)
    calibrated = any(_calibrates(name, config) for name, config in passes)
    if calibrated or eval_data is not None:
        check_seq_len(adapter, seq_len)
        check_stock_model_builds(model_dir, adapter)
        check_tokenizer_files(model_dir)
    window = named("calibration.seq_len", seq_len)
    if calibrated and calib_tokens < seq_len:
        raise OptionError(f"{named('calibration.tokens', calib_tokens)} is less than one window of {window}")
    if eval_data is not None:
        check_eval_window(seq_len, eval_tokens, eval_tokens != DEFAULT_EVAL_TOKENS)
    if calibrated and calib_source is not None:
        check_data_spec(calib_source, named("calibration.source"))
    if eval_data is not None:
        check_data_spec(eval_data, named("evaluation.data"))


def _calibrates(name: str, config: Any) -> bool:
    """Whether the pass reads calibration windows (a whole-model pass always; a layer pass where it measures,
    calibrates or asks for a sensitivity: plain RTN quantisation reads none)."""
    from ..passes.registry import PASSES

    entry = PASSES[name]
    if entry.layer_pass is None:
        return True
    needs = entry.layer_pass(config).needs()
    return bool(needs.measuring or needs.calibration or needs.sensitivity)


def _check_pass(config: Any, facts: Any) -> None:
    """The pass's own checks against the input (:class:`~moecompress.passes.base.InputFacts`), where its config
    has a ``check_input``."""
    check_input = getattr(config, "check_input", None)
    if check_input is not None:
        check_input(facts)


def check_output_smaller(model_dir: Path, config: Any) -> None:
    """A low-rank budget (bits per routed expert weight, docs/lowrank.md) that, with the scheme's own bits per
    weight, makes the experts at least as large as the input's is refused: the output would not be compressed."""
    if not config.lowrank_budget:
        return
    from ..evals.footprint import checkpoint_footprint

    experts = checkpoint_footprint(model_dir).classes.get("experts")
    if experts is None or not experts.weights:
        return
    scheme = config.quant_scheme()
    output = scheme_bits_per_weight(scheme) + config.lowrank_budget
    if output >= experts.bits_per_weight:
        raise OptionError(
            f"{named('lowrank_budget', config.lowrank_budget)} would make the experts at least {output:.3f} bits per "
            f"weight ({scheme.describe()} and the adapters), not fewer than the input's "
            f"{experts.bits_per_weight:.3f}",
            type(config),
        )


def scheme_bits_per_weight(scheme: Any) -> float:
    """Bits per weight of ``scheme`` as stored: codes, scales and zero points (measured on a small matrix), plus
    the 16 bits of each salient weight's kept value (its position's bits left out: a lower bound)."""
    from dataclasses import replace

    plain = replace(scheme, salient_fraction=0.0)
    stored = plain.quantize(torch.zeros(2, 512, device="cpu"))
    return 8 * stored.nbytes / stored.numel + 16 * scheme.salient_fraction


def partial_work(out_dir: Path) -> list[Path]:
    """The hidden directories an interrupted run into ``out_dir`` leaves beside it."""
    from ..checkpoint.writer import PARTIAL_WORK, hidden_dir

    found = [hidden_dir(Path(out_dir).absolute(), kind) for kind in PARTIAL_WORK]
    return [path for path in found if path.exists()]


def check_partial_work(out_dir: Path, *, resume: bool, restart: bool) -> None:
    """Refuse to start over an interrupted run's partial work unless told what to do with it: ``resume`` keeps
    it, ``restart`` has it removed (by :func:`discard_partial_work`, once every other check passed); neither
    refuses, since discarding hours of work must be asked for."""
    if resume and restart:
        raise OptionError(f"{named('run.resume')} and {named('run.restart')} exclude each other")
    found = partial_work(out_dir)
    if found and not resume and not restart:
        raise OptionError(f"{found[0]}: partial work of an interrupted run into {out_dir}; {RESTART_HINT}")


def discard_partial_work(out_dir: Path) -> None:
    """Remove an interrupted run's partial work; under ``torchrun`` rank 0 alone removes it, the others wait."""
    from ..calibration import distributed

    distributed.on_writer(lambda: _remove_partial_work(out_dir), share=False)


def _remove_partial_work(out_dir: Path) -> None:
    for path in partial_work(out_dir):
        shutil.rmtree(path)


def check_output(
    out_dir: Path,
    model_dir: Path,
    *,
    overwrite: bool,
    resume: bool,
    restart: bool,
    discard: bool = True,
) -> None:
    """The output-side checks every writing command (and the Python API) makes before any work: ``out_dir`` is not
    the input nor inside it, can be created, is not there already (unless ``overwrite``), and no interrupted run's
    partial work is there unless ``resume`` or ``restart`` says what to do with it. With ``restart`` and
    ``discard`` the partial work is removed here; a caller with checks still to make passes ``discard=False`` and
    calls :func:`discard_partial_work` after them. ``overwrite`` replaces only what :func:`check_replaceable`
    allows.

    The output's lock (:mod:`~moecompress.runner.lock`) is taken before the partial work is looked at and held until
    the caller releases it or the process ends, so a run still going into ``out_dir`` refuses this one. Refusals
    are :class:`~moecompress.errors.OptionError`: the caller's layer spells ``out`` and ``overwrite``.

    Under ``torchrun`` rank 0 alone looks at the output, since it alone writes there, and its verdict (or error)
    reaches every rank: a slower rank would otherwise find the partial work rank 0 has already started for the
    same command and refuse."""
    from ..calibration import distributed

    distributed.init_from_environment()
    checks = dict(overwrite=overwrite, resume=resume, restart=restart, discard=discard)
    distributed.on_writer(lambda: _check_output(Path(out_dir), Path(model_dir), **checks), share=False)


def _check_output(
    out_dir: Path, model_dir: Path, *, overwrite: bool, resume: bool, restart: bool, discard: bool
) -> None:
    from ..checkpoint.stream import check_output_is_not_input
    from . import lock as run_lock

    check_output_is_not_input(model_dir, out_dir)
    label = named("run.out", out_dir)
    if out_dir.exists() or out_dir.is_symlink():
        if not overwrite:
            raise OptionError(f"{out_dir}: output directory exists (pass {named('run.overwrite', True)} to replace it)")
        check_replaceable(out_dir, label=label)
    check_writable(out_dir, label=label)
    run_lock.acquire(out_dir, label=label)
    try:
        check_partial_work(out_dir, resume=resume, restart=restart)
    except BaseException:
        run_lock.release(out_dir)
        raise
    if restart and discard:
        _remove_partial_work(out_dir)


OUTPUT_MARKERS = ("moecompress_report.json", "moecompress_export.json", INCOMPLETE_MARKER)
"""Files that make a directory moecompress's output: a run's report, an export's report, the unfinished mark."""


def check_replaceable(out_dir: Path, *, label: str | None = None) -> None:
    """``--overwrite`` replaces (deletes, then writes anew) only an empty directory or one moecompress wrote
    (:data:`OUTPUT_MARKERS`), never the working directory or one above it, a link or a file: a mistyped
    ``--out`` must not delete someone's files. ``label``: how the refusal begins (:func:`named`'s ``run.out``)."""
    flag = named("run.overwrite", True)
    label = label or named("run.out", out_dir)
    path = Path(out_dir).absolute()
    here = Path.cwd().resolve()
    if path.is_symlink():
        raise OptionError(f"{label}: a symbolic link; {flag} replaces only a directory moecompress wrote")
    if not path.is_dir():
        raise OptionError(f"{label}: a file, not a directory; {flag} replaces only a directory moecompress wrote")
    if path.resolve() == here or path.resolve() in here.parents:
        raise OptionError(
            f"{label}: the working directory{'' if path.resolve() == here else ' or one above it'}; "
            f"{flag} never replaces it (name a new directory)"
        )
    if any(path.iterdir()) and not any((path / name).is_file() for name in OUTPUT_MARKERS):
        raise OptionError(
            f"{label}: not a moecompress output (no moecompress_report.json) and not empty; {flag} replaces only "
            "those, so nothing was deleted"
        )


def check_not_in_inputs(target: Path, inputs: list[Path | None], label: str) -> None:
    """A file or directory to be written at ``target`` is none of ``inputs`` (models, data files, reports' runs)
    and lies inside none of them: no command writes inside what it reads."""
    real = Path(target).expanduser().resolve()
    for source in inputs:
        if source is None:
            continue
        source = Path(source).expanduser().resolve()
        if real == source or source in real.parents:
            raise UserInputError(
                f"{label}: {'is' if real == source else 'inside'} the input {source}; moecompress never writes "
                "into its input (name a path outside it)"
            )


def check_file_target(target: Path, label: str) -> None:
    """A file to be written at ``target`` (``--json-out``, ``--plot``) can be: its directory exists and takes a
    (removed at once) probe file, and ``target`` is not a directory, so the result of a long evaluation is not
    lost at its end."""
    target = Path(target).expanduser()
    parent = target.absolute().parent
    if target.is_dir():
        raise UserInputError(f"{label}: a directory; name a file")
    if not parent.exists():
        raise UserInputError(f"{label}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise UserInputError(f"{label}: {parent} is not a directory")
    try:
        handle, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".probe", dir=parent)
    except OSError as error:
        raise UserInputError(f"{label}: cannot write in {parent} ({error.strerror})") from None
    os.close(handle)
    os.unlink(probe)


def check_not_replacing_inputs(out_dir: Path, inputs: list[Path]) -> None:
    """No input (a recipe file, a data file) lies inside ``out_dir`` when ``out_dir`` exists and would be replaced."""
    out_dir = Path(out_dir).absolute()
    if not out_dir.exists():
        return
    for source in inputs:
        if out_dir.resolve() in Path(source).expanduser().resolve().parents:
            raise UserInputError(f"{source}: an input inside {out_dir}, which overwriting it would delete; move it out")


def data_paths(spec: str) -> list[Path]:
    """The local files and directories among a comma-separated data source ``spec``."""
    pieces = [piece.strip() for piece in spec.split(",") if piece.strip()]
    return [Path(p) for p in pieces if not p.startswith(("builtin:", "hf:")) and Path(p).expanduser().exists()]


def check_writable(out_dir: Path, label: str | None = None) -> None:
    """``out_dir`` can be created: its nearest existing ancestor is a directory in which a (removed at once)
    hidden probe directory can be made. Permission bits alone do not tell, for root or on read-only mounts.
    Only the writing rank probes: the other ranks of a torchrun job (``RANK`` above 0, read from the launcher's
    environment since the check runs before the process group starts) create nothing."""
    if int(os.environ.get("RANK", "0") or 0) > 0:
        return
    out_dir = Path(out_dir).absolute()
    label = label or named("run.out", out_dir)
    ancestor = out_dir.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OptionError(f"{label}: {ancestor} is not a directory")
    try:
        probe = tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".probe", dir=ancestor)
    except OSError as error:
        raise OptionError(f"{label}: cannot write in {ancestor} ({error.strerror})") from None
    os.rmdir(probe)
