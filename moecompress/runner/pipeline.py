"""The one driver of a recipe's layer passes: every pass in the same layer sweeps, the output written once.

A recipe's consecutive layer passes (:mod:`moecompress.passes.registry`) form one *stage*, run as:

1. the sensitivity sweep, only if a pass asks for a downstream sensitivity (the low-rank budget's Fisher factor:
   a streamed forward, then a backward one layer at a time);
2. one measuring sweep, only if a pass needs a global decision: every layer is read once and calibrated, and every
   pass measures what it needs on it (MAEP scores, every expert matrix's error spectrum); then every pass decides
   from all layers' measurements (the expert ranking, the rank budget);
3. one rewriting sweep: per decoder layer, read once, calibrate (if a pass needs routed inputs), apply the passes
   in recipe order (prune experts -> quantise -> low-rank adapters), write the layer once, and recompute its
   outputs through the rewritten block (pruned, quantised) as the next layer's inputs (sequential calibration;
   the recomputing forward reuses the layer's attention outputs, :mod:`moecompress.sweep.attention_replay`, and the last
   layer is not recomputed where no MTP layer reads its outputs). Each sweep asks the kernel to read the next layer
   ahead while it computes one (:meth:`~moecompress.checkpoint.CheckpointReader.advise`).

The measuring sweep runs on the original weights: a pruning decision is global, known only after it. A low-rank
budget is therefore spent on spectra and loads measured before pruning; the spectra of the experts pruning removes
are dropped at decision time (or, where a layer's own scores decide its removals, ``scope: layer``, never
measured: :meth:`LayerPass.keeps`) and the budget counts the kept experts only. The rewriting sweep recomputes each
kept expert's spectrum on the pruned, sequentially calibrated block and keeps the ranks it was given.

A whole-model pass (``qat``, ``prune_heads``) is a stage of its own, run on the previous stage's result through
its registry entry (:attr:`~moecompress.passes.base.PassEntry.run_whole_model`, by :func:`run_whole_model_pass`).
Every pass runs here, one or many: the ``prune`` and ``quantize`` commands and their API calls are one-pass
recipes; the ``qat`` and ``prune-heads`` commands and the library functions ``prune_experts`` and
``quantize_checkpoint`` run :func:`run_one_pass`. Under torchrun the ranks share the measuring sweep
(:func:`run_layer_passes`); a quantised release pruned without calibration keeps its kept experts as stored
(:meth:`~moecompress.passes.base.LayerPass.stored_rewrite`).
:func:`plan_stages` groups a recipe; :func:`describe_plan` is what ``moecompress run --dry-run`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from ..calibration import distributed
from ..calibration.model_inputs import calibration_batches
from ..checkpoint import CheckpointReader, CheckpointWriter, group_keys_by_layer
from ..checkpoint.stream import OUTSIDE_UNIT, align_resumed_sweep, check_output_is_not_input, layer_unit
from ..checkpoint.writer import DEFAULT_MAX_SHARD_BYTES
from ..errors import OptionError, UserInputError
from ..families import FamilyAdapter, MoEWeights
from ..memory import release_freed_memory
from ..output_report import REPORT_NAME, update_report
from ..passes.base import CalibrationData, LayerPass, PassContext
from ..passes.registry import PASSES
from ..progress import bar as progress_bar
from ..sweep.engine import CalibrationSweep
from ..sweep.state import LayerResult, SweepState
from ..sweep.view_experts import ExpertSource
from ..vocabulary import named

CALIBRATION_BATCH = 8


@dataclass
class Stage:
    """Consecutive layer passes run by one pipeline, or one whole-model pass."""

    kind: str
    passes: list[tuple[str, Any]] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.passes]

    @property
    def name(self) -> str:
        return "+".join(self.names)


def plan_stages(passes: list[tuple[str, Any]], *, chained: bool = False) -> list[Stage]:
    """Group ``passes`` into stages: consecutive layer passes share one pipeline (a pass named twice starts a
    new one). ``chained`` gives every pass its own stage, as recipes ran before the pipeline."""
    stages: list[Stage] = []
    for name, config in passes:
        kind = PASSES[name].kind
        last = stages[-1] if stages else None
        if not chained and kind == "layer" and last is not None and last.kind == "layer" and name not in last.names:
            last.passes.append((name, config))
        else:
            stages.append(Stage(kind, [(name, config)]))
    return stages


def _layer_passes(passes: list[tuple[str, Any]]) -> list[LayerPass]:
    return [PASSES[name].layer_pass(config) for name, config in passes]


@dataclass(frozen=True)
class Sweeps:
    """Which sweeps a stage of layer passes runs, decided from the passes' configs alone."""

    sensitivity: list[str]
    measuring: list[tuple[str, str]]
    calibrated: bool
    sequential: bool

    @property
    def reads(self) -> int:
        """How many times the sweeps read the input checkpoint (the sensitivity sweep reads it twice: a forward,
        then a backward one layer at a time)."""
        return 2 * bool(self.sensitivity) + bool(self.measuring) + 1


def plan_sweeps(passes: list[LayerPass]) -> Sweeps:
    needs = [p.needs() for p in passes]
    calibrated = any(n.calibration for n in needs)
    return Sweeps(
        sensitivity=sorted({n.sensitivity for n in needs if n.sensitivity}),
        measuring=[(p.name, n.measuring) for p, n in zip(passes, needs, strict=True) if n.measuring],
        calibrated=calibrated,
        sequential=calibrated and any(n.sequential for n in needs),
    )


def describe_plan(recipe) -> list[str]:
    """The plan of ``recipe`` (a :class:`~moecompress.runner.recipes.Recipe`): its stages, the sweeps of each with the
    passes in them, and how many times each reads a checkpoint. Nothing is read to make it."""
    lines, reads = [], 0
    stages = plan_stages(recipe.passes)
    for number, stage in enumerate(stages, start=1):
        source = "the input" if number == 1 else f"stage {number - 1}'s output"
        last = number == len(stages)
        writes = "the output" if last else "an intermediate checkpoint"
        if stage.kind == "model":
            lines.append(f"stage {number}: {stage.name} (whole model): loads {source}, writes {writes}")
            reads += 1
            continue
        passes = _layer_passes(stage.passes)
        sweeps = plan_sweeps(passes)
        lines.append(f"stage {number}: one layer pipeline of {', '.join(stage.names)}, on {source}")
        if sweeps.sensitivity:
            lines.append(
                f"  sensitivity sweep ({', '.join(sweeps.sensitivity)}): a forward then a backward one layer at a "
                "time; reads it twice"
            )
        if sweeps.measuring:
            measured = "; ".join(f"{name}: {what}" for name, what in sweeps.measuring)
            lines.append(f"  measuring sweep (original weights): {measured}; reads it once; then the passes decide")
        calibration = "calibrated, sequential" if sweeps.sequential else "calibrated" if sweeps.calibrated else "plain"
        steps = " -> ".join(f"{p.name}: {p.needs().rewrites}" if p.needs().rewrites else p.name for p in passes)
        lines.append(f"  rewriting sweep ({calibration}): per layer {steps}; reads it once, writes {writes} once")
        reads += sweeps.reads
    if recipe.evaluation is not None:
        lines.append(
            f"evaluation: {recipe.evaluation.data}, {recipe.evaluation.tokens} tokens, "
            "the output against the input (reads both)"
        )
    lines.append(f"checkpoint reads before the evaluation: {reads}")
    return lines


def _combine(parts: dict[int, LayerResult]) -> LayerResult:
    tensors = {f"p{index}.{name}": tensor for index, (stored, _) in parts.items() for name, tensor in stored.items()}
    return tensors, {str(index): meta for index, (_, meta) in parts.items()}


def _part(result: LayerResult, index: int) -> LayerResult:
    tensors, meta = result
    prefix = f"p{index}."
    return {name[len(prefix) :]: t for name, t in tensors.items() if name.startswith(prefix)}, meta[str(index)]


def _sweep(context: PassContext, batches, tags, **options) -> CalibrationSweep:
    """The one place a calibration sweep of the pipeline is built."""
    data = context.calibration
    return CalibrationSweep(context.model_dir, batches, tags, data.tag_names, progress=context.progress, **options)


def _measuring_sweep(passes: list[LayerPass], context: PassContext) -> None:
    """Every pass measures each layer; under torchrun each rank sweeps its share of the batches (the passes add
    their statistics over ranks) and only a single process keeps a resumable state."""
    needs = [p.needs() for p in passes]
    measuring = [(index, p) for index, (p, n) in enumerate(zip(passes, needs, strict=True)) if n.measuring]
    if not measuring:
        return
    state = None if context.state_dir is None else SweepState(context.state_dir / "measure")
    for layer, result in sorted(state.results().items()) if state is not None else ():
        for index, p in measuring:
            p.absorb(layer, _part(result, index))
    shard = distributed.shard_calibration(context.calibration.batches, context.calibration.tags)
    sweep = _sweep(
        context,
        shard.batches,
        shard.tags,
        capture_attention=any(needs[index].attention for index, _ in measuring),
        moe_in_compute_dtype=all(needs[index].weights_only for index, _ in measuring),
    )
    for capture in sweep.run(state, label="measuring"):
        parts = {}
        for index, p in measuring:
            parts[index] = p.measure(capture)
            p.absorb(capture.layer, parts[index])
            capture.keep = p.keeps(capture.layer) or capture.keep
        capture.result = _combine(parts)
    mtp_scorers = [p for _, p in measuring if getattr(p.config, "mtp", "drop") == "keep"]
    if mtp_scorers:
        from ..sweep.mtp import mtp_captures

        for capture in mtp_captures(sweep, shard.batches):
            for p in mtp_scorers:
                p.absorb(capture.layer, p.measure(capture))


def _router_replacement(original: MoEWeights, weights: MoEWeights) -> MoEWeights | None:
    """A block of ``original``'s size routing with ``weights``'s router where that changed (merged or refitted
    rows, at their experts' original indices; removed experts' rows stay, never chosen; a hash-routed block's table
    naming the original indices), else None."""
    rows = [original.expert_ids.index(expert) for expert in weights.expert_ids]
    rows += list(range(original.num_experts, original.router_columns))
    index = torch.tensor(rows, dtype=torch.long, device="cpu")
    changes = {}
    for name in MoEWeights.ROUTER_TENSORS:
        new, old = getattr(weights, name), getattr(original, name)
        if new is None or old is None:
            continue
        picked = old.index_select(0, index[: new.shape[0]])
        if picked.dtype != new.dtype or not torch.equal(picked, new):
            full = old.clone()
            full[index[: new.shape[0]]] = new.to(old.dtype)
            changes[name] = full
    if weights.token_table is not None and original.token_table is not None:
        table = index[weights.token_table.long()].to(original.token_table.dtype)
        if not torch.equal(table, original.token_table):
            changes["token_table"] = table
    return replace(original, **changes) if changes else None


def _replacement(original: MoEWeights, block: Any) -> tuple[ExpertSource, torch.Tensor | None]:
    """What the next layer's calibration should see of a rewritten block: its experts (a quantised block
    dequantised one expert at a time as the layer computes), placed at the original block's expert indices (the
    stock layer and its router are built for it); removed experts are indices the router may not choose (its identity
    experts, past the FFN experts, always may)."""
    dequantize = getattr(block, "dequantized_expert", None)
    weights = block.weights if dequantize is not None else block
    if weights.num_experts == original.num_experts:
        return ExpertSource(weights, dequantize), None
    positions = [-1] * original.num_experts
    for position, expert in enumerate(weights.expert_ids):
        positions[original.expert_ids.index(expert)] = position
    chosen = [position >= 0 for position in positions] + [True] * original.identity_experts
    allowed = torch.tensor(chosen, dtype=torch.bool, device="cpu")
    return ExpertSource(weights, dequantize, positions), allowed


class _LayerWriter:
    """Applies the passes to one layer and writes it as one journalled unit of ``writer``."""

    def __init__(self, passes: list[LayerPass], adapter: FamilyAdapter, writer: CheckpointWriter):
        self.passes, self.adapter, self.writer = passes, adapter, writer
        writers = [p for p in passes if p.writes_layers]
        self.layout_pass = writers[-1] if writers else None

    def _meta(self, unit: str) -> dict[str, Any]:
        entries = {p.name: p.unit_meta(unit) for p in self.passes}
        return {name: entry for name, entry in entries.items() if entry is not None}

    def restore_all(self) -> None:
        for unit, record in self.writer.units.items():
            for p in self.passes:
                entry = (record.meta or {}).get(p.name)
                if entry is not None:
                    p.restore(unit, entry)

    def outside(self, tensors: dict[str, torch.Tensor]) -> None:
        for p in self.passes:
            tensors = p.write_outside(tensors)
        self.writer.add(tensors, unit=OUTSIDE_UNIT, meta=self._meta(OUTSIDE_UNIT))

    def layer(self, layer: int, moe: MoEWeights | None, rest: dict, layout: Any, capture) -> Any:
        block = moe
        for p in self.passes:
            block = p.rewrite(layer, block, capture)
            rest = p.rewrite_rest(layer, rest)
        if self.layout_pass is not None:
            tensors = self.layout_pass.write_layer(layer, block, rest)
        else:
            tensors = self.adapter.join_layer(layer, block, rest, layout)
        self.stored(layer, tensors)
        return block

    def stored(self, layer: int, tensors: dict[str, torch.Tensor]) -> None:
        unit = layer_unit(layer)
        self.writer.add(tensors, unit=unit, meta=self._meta(unit))


def _stored_rewrite(passes: list[LayerPass], sweeps: Sweeps):
    """One function rewriting a layer as stored, where the stage reads no calibration and every pass gives one
    (pruning a quantised release copies its kept experts' codes and scales); else None."""
    functions = [p.stored_rewrite() for p in passes]
    if sweeps.calibrated or not all(functions):
        return None

    def rewrite(layer: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for function in functions:
            tensors = function(layer, tensors)
        return tensors

    return rewrite


def _rewriting_sweep(passes: list[LayerPass], context: PassContext, adapter: FamilyAdapter, writer) -> None:
    from ..checkpoint.mtp import mtp_layers

    sweeps = plan_sweeps(passes)
    write = _LayerWriter(passes, adapter, writer)
    stored = _stored_rewrite(passes, sweeps)
    with CheckpointReader(context.model_dir, decode=stored is None) as reader:
        layers, outside = group_keys_by_layer(reader, adapter)
        state = None
        if sweeps.calibrated:
            state = SweepState(context.state_dir / "rewrite")
            align_resumed_sweep(state, writer)
        write.restore_all()
        if OUTSIDE_UNIT not in writer.units:
            dropped_keys = context.extra.get("drop_keys", frozenset())
            write.outside(reader.read([key for key in outside if key not in dropped_keys]))
        dropped = context.extra.get("drop_layers", frozenset())
        if state is not None:
            data = context.calibration
            mtp = [layer for layer in mtp_layers(adapter, reader.keys()) if layer not in dropped]
            sweep = _sweep(
                context,
                data.batches,
                data.tags,
                keep_tensors=True,
                replaces=sweeps.sequential,
                last_outputs_unused=sweeps.sequential and not mtp,
            )
            for layer_pass in passes:
                layer_pass.attach_sweep(sweep)
            for capture in sweep.run(state, label="rewriting"):
                block = write.layer(capture.layer, capture.moe, capture.rest, capture.layout, capture)
                capture.replacement = capture.allowed = capture.router = None
                if sweeps.sequential and capture.moe is not None and block is not capture.moe:
                    capture.replacement, capture.allowed = _replacement(capture.moe, block)
                    capture.router = _router_replacement(capture.moe, capture.replacement.view)
                del block
        if state is not None:
            _write_mtp_layers(sweep, write, writer, dropped, data.batches)
        remaining = [layer for layer in layers if layer_unit(layer) not in writer.units and layer not in dropped]
        following = dict(pairwise(remaining))
        for layer in progress_bar(remaining, desc="writing", unit="layer", disable=not context.progress):
            if layer in following:
                reader.advise(layers[following[layer]])
            if stored is not None:
                write.stored(layer, stored(layer, reader.read_raw(layers[layer])))
                continue
            moe, rest, layout = adapter.split_layer(layer, reader.pending(layers[layer]), consume=True)
            write.layer(layer, moe, rest, layout, None)
            del moe, rest
            release_freed_memory()


def _write_mtp_layers(sweep: CalibrationSweep, write: _LayerWriter, writer, dropped, batches) -> None:
    """The MTP layers of a calibrated rewriting sweep, each with its capture (its own MoE inputs, computed from the
    main layers' outputs as rewritten), after the main layers."""
    from ..checkpoint.mtp import mtp_layers

    pending = [
        layer
        for layer in mtp_layers(sweep.adapter, sweep.reader.keys())
        if layer not in dropped and layer_unit(layer) not in writer.units
    ]
    if not pending:
        return
    from ..sweep.mtp import mtp_captures

    for capture in mtp_captures(sweep, batches):
        if capture.layer in pending:
            write.layer(capture.layer, capture.moe, capture.rest, capture.layout, capture)
        capture.moe = capture.rest = capture.moe_input = capture.router_input = None
        release_freed_memory()


def run_one_pass(
    name: str,
    config: Any,
    model_dir: Path,
    out_dir: Path,
    *,
    calib: str,
    calib_tokens: int,
    seq_len: int,
    image_size: int,
    eval_data: str | None,
    eval_tokens: int | None,
    overwrite: bool,
    progress: bool,
    resume: bool,
) -> dict[str, Any]:
    """One pass as its own stage: what the ``qat`` and ``prune-heads`` commands and the library functions
    ``prune_experts`` and ``quantize_checkpoint`` run, with the calibration seeded by the pass's config and an
    evaluation when ``eval_data`` is given (a whole-model pass, which keeps no partial state, ignores ``resume``:
    it starts over)."""
    from .recipes import Calibration, Evaluation

    calibration = Calibration(
        source=calib, tokens=calib_tokens, seq_len=seq_len, seed=config.seed, image_size=image_size
    )
    evaluation = Evaluation(eval_data, eval_tokens) if eval_data else None
    if PASSES[name].kind == "model":
        return run_whole_model_pass(
            model_dir,
            out_dir,
            (name, config),
            calibration,
            evaluation=evaluation,
            overwrite=overwrite,
            progress=progress,
        )
    return run_layer_passes(
        model_dir,
        out_dir,
        [(name, config)],
        calibration,
        overwrite=overwrite,
        progress=progress,
        resume=resume,
        evaluation=evaluation,
    )


def run_whole_model_pass(
    model_dir: Path,
    out_dir: Path,
    step: tuple[str, Any],
    calibration,
    *,
    evaluation=None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Run the whole-model pass ``step`` (``(name, config)``) on ``model_dir`` into ``out_dir`` by way of its
    registry entry; returns its report (also saved as moecompress_report.json). ``calibration`` is the recipe's
    :class:`~moecompress.runner.recipes.Calibration`; with ``evaluation`` the pass evaluates its output against the
    input itself (QAT and head pruning also measure before their training)."""
    name, config = step
    return PASSES[name].run_whole_model(
        Path(model_dir),
        Path(out_dir),
        config,
        calibration=calibration,
        evaluation=evaluation,
        overwrite=overwrite,
        progress=progress,
    )


def write_model(
    model_dir: Path,
    out_dir: Path,
    rewriter: LayerPass,
    *,
    overwrite: bool,
    progress: bool,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write ``model_dir`` into ``out_dir`` through the uncalibrated rewriting sweep with ``rewriter`` its one pass:
    how a whole-model pass writes what it trained (the rewriter replaces the tensors it changed, as stored or in the
    layer's view; its :meth:`~LayerPass.report` and :meth:`~LayerPass.finish_config` complete the output); the
    tests copy checkpoints through it too (``max_shard_bytes``: several small shards). A whole-model pass cannot
    resume its writing, so a failed write leaves nothing behind."""
    from ..loading import load_adapter

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    adapter = load_adapter(model_dir)
    writer = CheckpointWriter(out_dir, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
    context = PassContext(model_dir, adapter, None, writer.state_dir, progress, out_dir=out_dir)
    try:
        _rewriting_sweep([rewriter], context, adapter, writer)
        writer.copy_side_files(model_dir)
        writer.write_json("moecompress_report.json", rewriter.report())
        return writer.finish(rewriter.finish_config(dict(adapter.config)))
    except BaseException:
        writer.abort()
        raise


def run_layer_passes(
    model_dir: Path,
    out_dir: Path,
    passes: list[tuple[str, Any]],
    calibration,
    *,
    overwrite: bool = False,
    progress: bool = True,
    resume: bool = False,
    evaluation=None,
) -> dict[str, Any]:
    """Run one stage of layer passes on ``model_dir`` into ``out_dir``; returns the last pass's report, with the
    earlier passes' reports under ``previous_passes`` (also saved as moecompress_report.json).

    ``calibration`` is the recipe's :class:`~moecompress.runner.recipes.Calibration`; its windows are drawn with the
    first pass's seed (the recipe's unless the pass sets its own), and every sweep shares them. With ``resume`` a killed
    run continues: the sensitivity, the measured layers and the written layers are kept, and the output is
    byte-identical to an uninterrupted run's. With ``evaluation`` (a :class:`~moecompress.runner.recipes.Evaluation`)
    the output is evaluated against the input and the result joins the report as ``eval``.

    Under ``torchrun`` (``WORLD_SIZE`` above 1) the ranks share the measuring sweep's batches; rank 0 alone creates
    ``out_dir``, decides, writes and evaluates, the others wait for it and return the same report. The output is
    byte-identical to a single-process run's; a stage whose rewriting sweep calibrates, and ``resume``, need a
    single process."""
    from ..loading import load_adapter

    for _, config in passes:
        config.validate()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_output_is_not_input(model_dir, out_dir)
    distributed.init_from_environment()
    layer_passes = _layer_passes(passes)
    sweeps = plan_sweeps(layer_passes)
    _check_ranks(layer_passes, sweeps, resume)
    adapter = load_adapter(model_dir)
    data = None
    if sweeps.measuring or sweeps.calibrated:
        seed = getattr(passes[0][1], "seed", calibration.seed)
        batches, tags, tag_names = calibration_batches(
            adapter,
            model_dir,
            calibration.source,
            calibration.tokens,
            calibration.seq_len,
            CALIBRATION_BATCH,
            seed,
            calibration.image_size,
        )
        data = CalibrationData(batches, tags, tag_names, calibration.source, calibration.seq_len, seed)
    writer = distributed.on_writer(lambda: CheckpointWriter(out_dir, overwrite=overwrite, resume=resume), share=False)
    context = PassContext(
        model_dir,
        adapter,
        data,
        None if writer is None else writer.state_dir,
        progress and distributed.is_writer(),
        out_dir=out_dir,
        sensitivities={p.name: p.needs().sensitivity for p in layer_passes if p.needs().sensitivity},
    )
    try:
        with distributed.collective_phase():
            for p in layer_passes:
                p.prepare(context)
            _measuring_sweep(layer_passes, context)
    except (UserInputError, OSError):
        if writer is not None:
            writer.abort()
        raise

    def write() -> dict[str, Any]:
        try:
            for p in layer_passes:
                p.decide(context)
            _rewriting_sweep(layer_passes, context, adapter, writer)
            writer.copy_side_files(model_dir)
            writer.write_json(REPORT_NAME, _stage_report(layer_passes))
            config = dict(adapter.config)
            for p in layer_passes:
                config = p.finish_config(config)
            writer.finish(config)
        except (UserInputError, OSError):
            writer.abort()
            raise
        for p in layer_passes:
            p.finished(out_dir)
        report = _stage_report(layer_passes)
        if evaluation is not None:
            from ..evals.perplexity import evaluation_report

            report["eval"] = evaluation_report(
                out_dir,
                evaluation.data,
                seq_len=calibration.seq_len,
                max_tokens=evaluation.tokens,
                reference_dir=model_dir,
                progress=progress,
            )
        update_report(out_dir, report)
        return report

    return distributed.on_writer(write)


def _check_ranks(passes: list[LayerPass], sweeps: Sweeps, resume: bool) -> None:
    ranks = distributed.world_size()
    if ranks <= 1:
        return
    if resume:
        raise OptionError(
            f"{named('run.resume', True)} needs a single process, not {ranks} ranks; run it without torchrun"
        )
    if sweeps.calibrated:
        steps = "; ".join(p.needs().rewrites for p in passes)
        raise UserInputError(
            f"with {ranks} ranks only the measuring sweep is shared, and this stage calibrates its rewriting sweep "
            f"({steps}); run it in a single process, without torchrun"
        )


def _stage_report(passes: list[LayerPass]) -> dict[str, Any]:
    reports = [p.report() for p in passes]
    if len(reports) == 1:
        return reports[0]
    return {**reports[-1], "previous_passes": reports[:-1]}
