"""Attention-head pruning: learn one binary gate per KV group (or per query head) on the frozen model, remove
the closed units physically, distil the pruned model towards the original, write the checkpoint.

Methods: ``learned`` (gates trained against KL to the original's logits under a Lagrangian sparsity objective,
see :mod:`moecompress.heads.gates`), ``magnitude`` (the Frobenius norm of each unit's weights) and ``random``
(seeded uniform scores). Every method removes the same number of units; distillation is the same for all.
``scope="layer"`` removes the same number from every layer (outputs load in stock transformers);
``scope="global"`` (KV groups only) ranks units over all layers, so counts may differ per layer and the output
loads after ``import moecompress``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..calibration.batches import consecutive_windows, tokenize_documents
from ..calibration.model_inputs import calibration_batches
from ..calibration.sources import load_documents
from ..checkpoint import CheckpointReader
from ..checkpoint.stream import check_output_is_not_input
from ..checkpoint.writer import output_exists
from ..defaults import DEFAULT_CALIB_TOKENS, DEFAULT_DATA, DEFAULT_EVAL_TOKENS, DEFAULT_SEQ_LEN, SCOPES
from ..device import HOST, compute_device, device_map_for, to_host
from ..errors import OptionError, UserInputError
from ..evals.perplexity import evaluate_windows, evaluation_report
from ..families import FamilyAdapter, adapter_for
from ..heads import GateMasks, HeadGates, HeadLayout, slice_attention
from ..heads.layout import UNITS
from ..heads.selection import choose_keep, global_removal_counts, magnitude_scores, random_scores, removal_counts
from ..heads.train import GateRun, GateSchedule, Teacher, distill, model_device, train_gates
from ..loading import load_adapter, load_model, load_tokenizer
from ..output_report import update_report
from ..vocabulary import named
from .base import InputFacts, LayerPass
from .options import When, check_declared, option, recipe_only

METHODS: tuple[str, ...] = ("learned", "magnitude", "random")
GATE_OBJECTIVES: tuple[str, ...] = ("lm", "kl")
LEARNED = When(named("method", "learned"), lambda c: c.method == "learned")
DISTILLED = When(f"{named('distill_steps')} above 0", lambda c: c.distill_steps > 0)
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class PruneHeadsConfig:
    ratio: float = field(
        default=0.25,
        metadata=option(
            "Fraction of the units to remove, in (0, 1): of each layer's KV groups (or query heads), or of all KV "
            "groups with --scope global. Must leave every layer at least one.",
            min=0,
            max=1,
            min_open=True,
            max_open=True,
            required=True,
        ),
    )
    unit: str = field(
        default="kv-group",
        metadata=option(
            "kv-group: a gate per KV head and the query heads that read it (shrinks the KV cache); query-head: a "
            "gate per query head, the same number removed from every KV group (KV cache unchanged).",
            choices=UNITS,
        ),
    )
    method: str = field(
        default="learned",
        metadata=option(
            "learned: binary gates trained on the frozen model under a Lagrangian sparsity objective; magnitude: "
            "the Frobenius norm of each unit's q/k/v/o weights; random: seeded random choice (baselines).",
            choices=METHODS,
        ),
    )
    scope: str = field(
        default="layer",
        metadata=option(
            "layer: the same number from every layer (loads in stock transformers); global: KV groups ranked over "
            "all layers, counts differ per layer (loads after `import moecompress`).",
            choices=SCOPES,
        ),
    )
    steps: int = field(default=200, metadata=option("Gate-training steps.", min=1, applies=LEARNED))
    lr: float = field(
        default=10.0,
        metadata=option("Gate learning rate (plain SGD on the gate logits).", min=0, min_open=True, applies=LEARNED),
    )
    lambda_lr: float = field(
        default=2.0,
        metadata=recipe_only(
            "Learning rate of the sparsity constraint's Lagrange multipliers (ascent).",
            min=0,
            min_open=True,
            applies=LEARNED,
        ),
    )
    init_log_alpha: float = field(
        default=2.0, metadata=recipe_only("The gates' initial log-odds of being open.", applies=LEARNED)
    )
    temperature: float = field(
        default=2 / 3,
        metadata=recipe_only(
            "Temperature of the relaxed gate gradients pass through.", min=0, min_open=True, applies=LEARNED
        ),
    )
    noise_bias: float = field(
        default=0.0,
        metadata=option(
            "Shift of the gates' logistic sampling noise toward closing at the start of training, decaying linearly "
            "to 0 over the warm-up (the first half of --steps). 0 (default) disables it: on tiny-moe 2.0 tied at 25% "
            "and hurt at 50% (docs/heads.md).",
            min=0,
            applies=LEARNED,
        ),
    )
    warmup_fraction: float = field(
        default=0.5,
        metadata=recipe_only(
            "Share of the gate-training steps over which the open-unit target ramps down and the noise bias decays.",
            min=0,
            max=1,
            min_open=True,
            applies=LEARNED,
        ),
    )
    gate_objective: str = field(
        default="lm",
        metadata=option(
            "What the gates minimise: lm (next-token cross-entropy) or kl (KL to the original model's logits).",
            choices=GATE_OBJECTIVES,
            applies=LEARNED,
        ),
    )
    distill_steps: int = field(
        default=100,
        metadata=option(
            "Steps of distillation (KL to the original's logits) of the pruned model's attention and norms; 0 skips.",
            min=0,
        ),
    )
    distill_lr: float = field(
        default=3e-4, metadata=option("Distillation learning rate.", min=0, min_open=True, applies=DISTILLED)
    )
    batch_size: int = field(default=8, metadata=option("Windows per step.", min=1))
    seed: int = field(default=0, metadata=option("Seed for windows, gate noise and --method random."))

    def validate(self) -> None:
        def refuse(template: str) -> OptionError:
            return OptionError(template, PruneHeadsConfig)

        check_declared(self)
        if self.scope == "global" and self.unit != "kv-group":
            raise refuse(f"{named('scope', 'global')} ranks KV groups; query-head units are pruned per layer")

    def check_input(self, facts: InputFacts) -> None:
        """Refuse a quantised input, and a ratio its heads cannot give, before any work."""
        from ..runner.preflight import check_prune_heads

        if facts.quantized:
            raise UserInputError(
                f"{facts.model_dir}: already quantised ({facts.quantized}); prune the unquantised model, then quantise"
            )
        check_prune_heads(facts.adapter, self, facts.model_dir)


def head_layouts(adapter: FamilyAdapter, unit: str) -> list[HeadLayout]:
    _, _, head_dim = adapter.head_counts()
    return [HeadLayout(*adapter.heads_in_layer(layer), head_dim, unit) for layer in range(adapter.num_layers)]


def kv_cache_bytes_per_token(kv_heads: list[int], head_dim: int, element_bytes: int) -> int:
    """Keys and values of every layer for one token, in the checkpoint's dtype."""
    return sum(2 * kv * head_dim * element_bytes for kv in kv_heads)


def _attention_tensors(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {key[len(prefix) :]: tensor for key, tensor in state.items() if key.startswith(prefix)}


def _check_input(adapter: FamilyAdapter, layouts: list[HeadLayout], model_dir: Path, unit: str) -> None:
    adapter.check_head_pruning(str(model_dir))
    if unit == "kv-group" and all(layout.kv_heads < 2 for layout in layouts):
        raise UserInputError(f"{model_dir}: every layer has a single KV group; there are no KV groups to prune")
    if unit == "query-head" and all(layout.group_size < 2 for layout in layouts):
        raise UserInputError(
            f"{model_dir}: every KV group has a single query head; query heads cannot be pruned uniformly"
        )


def _constraints(layouts: list[HeadLayout], remove: list[int], scope: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each unit's constraint index (all layers concatenated) and each constraint's target count of open units:
    one per layer, one per (layer, KV group) for query heads, one over the model for global scope."""
    index, targets = [], []
    if scope == "global":
        total = sum(layout.units for layout in layouts)
        kept = torch.tensor([float(total - sum(remove))], device=HOST)
        return torch.zeros(total, dtype=torch.long, device=HOST), kept
    for layout, count in zip(layouts, remove, strict=True):
        if layout.unit == "kv-group":
            index += [len(targets)] * layout.units
            targets.append(float(layout.units - count))
        else:
            per_group = count // layout.kv_heads
            index += [len(targets) + layout.unit_group(u) for u in range(layout.units)]
            targets += [float(layout.group_size - per_group)] * layout.kv_heads
    return torch.tensor(index, dtype=torch.long, device=HOST), torch.tensor(targets, device=HOST)


def _global_removals(layouts: list[HeadLayout], ratio: float, scores: list[torch.Tensor], learned: bool) -> list[int]:
    if learned:
        # gate logits share one scale across layers: compare them as they are
        scores = [s - min(float(t.min()) for t in scores) + 1.0 for s in scores]
    return global_removal_counts(layouts, ratio, scores)


def build_pruned_model(
    model: torch.nn.Module, adapter: FamilyAdapter, new_config: dict[str, Any], keep: list[list[int]], layouts
) -> tuple[torch.nn.Module, FamilyAdapter]:
    """The pruned model in memory, on ``model``'s device: built from ``new_config`` (through the plugin where counts
    differ by layer) and loaded with the original weights, attention sliced."""
    import transformers

    new_adapter = adapter_for(new_config)
    config = type(model.config).from_dict(new_config)
    with model_device(model):
        student = getattr(transformers, new_adapter.auto_class).from_config(config, dtype=torch.float32)
    state = dict(model.state_dict())
    for layer, layout in enumerate(layouts):
        prefix = adapter.attention_prefix(layer)
        sliced = slice_attention(_attention_tensors(state, prefix), layout, keep[layer], adapter.qk_norm)
        state = {k: v for k, v in state.items() if not k.startswith(prefix)}
        state.update({prefix + name: tensor for name, tensor in sliced.items()})
    student.load_state_dict(state, strict=True)
    return student.eval(), new_adapter


def _distilled_parameters(student: torch.nn.Module, adapter: FamilyAdapter) -> list[torch.nn.Parameter]:
    """The decoder layers' attention projections and norms: what pruning changed or feeds directly."""
    chosen = []
    for name, param in student.named_parameters():
        wanted = adapter.layer_of_key(name) is not None and adapter.classify_key(name) in ("attention", "norms")
        param.requires_grad_(wanted)
        if wanted:
            chosen.append(param)
    return chosen


def _score(
    config: PruneHeadsConfig,
    model: torch.nn.Module,
    adapter: FamilyAdapter,
    layouts: list[HeadLayout],
    remove: list[int] | None,
    batches: list[torch.Tensor],
    teacher: Teacher,
    progress: bool,
) -> tuple[list[torch.Tensor], GateRun | None]:
    if config.method == "random":
        return [random_scores(layout, config.seed, layer) for layer, layout in enumerate(layouts)], None
    if config.method == "magnitude":
        state = model.state_dict()
        return [
            to_host(magnitude_scores(_attention_tensors(state, adapter.attention_prefix(layer)), layout))
            for layer, layout in enumerate(layouts)
        ], None
    total = sum(layout.units for layout in layouts)
    target_remove = remove if remove is not None else [0] * (len(layouts) - 1) + [round(config.ratio * total)]
    constraint_of_unit, targets = _constraints(layouts, target_remove, config.scope)
    gates = HeadGates([layout.units for layout in layouts], config.init_log_alpha, config.temperature)
    schedule = GateSchedule(
        config.steps, config.lr, config.lambda_lr, config.noise_bias, config.warmup_fraction, config.gate_objective
    )
    with GateMasks(model, adapter, layouts) as masks:
        run = train_gates(
            model, masks, gates, constraint_of_unit, targets, batches, teacher, schedule, config.seed, progress
        )
    return run.scores, run


def _eval_windows(model_dir: Path, data: str, seq_len: int, tokens: int | None):
    stream = tokenize_documents(load_documents(data, default_part="heldout"), load_tokenizer(model_dir))
    return consecutive_windows(stream, seq_len, tokens)


def prune_heads(
    model_dir: Path,
    out_dir: Path,
    config: PruneHeadsConfig,
    *,
    calib: str = DEFAULT_DATA,
    calib_tokens: int = DEFAULT_CALIB_TOKENS,
    seq_len: int = DEFAULT_SEQ_LEN,
    eval_data: str | None = None,
    eval_tokens: int | None = DEFAULT_EVAL_TOKENS,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Choose, remove and distil; returns the report also saved as moecompress_report.json.

    With ``eval_data`` the pruned model is evaluated against the input twice: in memory before distillation,
    and as written (loaded back from ``out_dir``) after it. The input (the teacher) and the pruned model are both
    held whole on the run's compute device; the weights come back to the host to be written.
    """
    from ..runner.pipeline import write_model

    config.validate()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_output_is_not_input(model_dir, out_dir)
    if out_dir.exists() and not overwrite:
        raise output_exists(out_dir)
    adapter = load_adapter(model_dir)
    layouts = head_layouts(adapter, config.unit)
    _check_input(adapter, layouts, model_dir, config.unit)
    remove = removal_counts(layouts, config.ratio) if config.scope == "layer" else None
    with CheckpointReader(model_dir) as reader:
        element_bytes = _DTYPE_BYTES.get(reader.tensors[adapter.attention_prefix(0) + "k_proj.weight"].dtype, 4)
    batches = [
        b["input_ids"]
        for b in calibration_batches(
            adapter, model_dir, calib, calib_tokens, seq_len, config.batch_size, config.seed, 0
        )[0]
    ]
    model = load_model(model_dir, adapter, device_map=device_map_for(compute_device()))
    for param in model.parameters():
        param.requires_grad_(False)
    vocab = model.get_output_embeddings().weight.shape[0]
    device = model_device(model)
    teacher = Teacher(lambda ids: model(input_ids=ids.to(device), use_cache=False).logits, batches, vocab)

    scores, run = _score(config, model, adapter, layouts, remove, batches, teacher, progress)
    if remove is None:
        remove = _global_removals(layouts, config.ratio, scores, config.method == "learned")
    keep = [choose_keep(s, layout, count) for s, layout, count in zip(scores, layouts, remove, strict=True)]
    kept_heads = {layer: layout.kept_heads(keep[layer]) for layer, layout in enumerate(layouts)}
    original_ids = {layer: adapter.original_head_ids(layer) for layer in range(len(layouts))}
    counts = {layer: (len(q), len(kv)) for layer, (q, kv) in kept_heads.items()}
    new_config = adapter.with_head_counts(
        counts, {layer: [original_ids[layer][h] for h in q] for layer, (q, _) in kept_heads.items()}
    )
    student, new_adapter = build_pruned_model(model, adapter, new_config, keep, layouts)

    eval_before = None
    windows = _eval_windows(model_dir, eval_data, seq_len, eval_tokens) if eval_data else None
    if windows is not None:
        eval_before = evaluate_windows(student, new_adapter, windows, (model, adapter), progress=progress).to_json()
    distill_curve: list[dict[str, float]] = []
    if config.distill_steps:
        parameters = _distilled_parameters(student, new_adapter)
        distill_curve = distill(
            student, parameters, batches, teacher, config.distill_steps, config.distill_lr, progress
        )
    student_state = {k: to_host(v.detach()) for k, v in student.state_dict().items()}

    head_dim = layouts[0].head_dim
    report: dict[str, Any] = {
        "pass": "prune_heads",
        "config": asdict(config),
        "calibration": {"source": calib, "tokens": sum(b.numel() for b in batches), "seq_len": seq_len},
        "source": str(model_dir),
        "family": adapter.family,
        "unit": config.unit,
        "units_before": sum(layout.units for layout in layouts),
        "units_after": sum(len(k) for k in keep),
        "uniform": len(set(counts.values())) == 1,
        "stock_loadable": adapter.stock_loads_head_counts(len(set(counts.values())) == 1),
        "kv_cache_bytes_per_token": {
            "before": kv_cache_bytes_per_token([layout.kv_heads for layout in layouts], head_dim, element_bytes),
            "after": kv_cache_bytes_per_token([kv for _, kv in counts.values()], head_dim, element_bytes),
            "element_bytes": element_bytes,
        },
        "layers": {
            str(layer): {
                "heads_before": [layout.heads, layout.kv_heads],
                "heads_after": list(counts[layer]),
                "kept_units": keep[layer],
                "kept_query_heads": [original_ids[layer][h] for h in kept_heads[layer][0]],
                "kept_kv_heads": kept_heads[layer][1],
                "removed_units": [u for u in range(layout.units) if u not in keep[layer]],
                "scores": [round(float(s), 5) for s in scores[layer]],
            }
            for layer, layout in enumerate(layouts)
        },
    }
    if run is not None:
        report["gates"] = {
            "trajectory_steps": run.trajectory_steps,
            "open_probability": run.trajectory,
            "curve": run.curve,
        }
    if distill_curve:
        report["distillation"] = {"parameters": "attention and norms of every decoder layer", "curve": distill_curve}
    if eval_before is not None:
        report["eval_before_distillation"] = {"data": eval_data, **eval_before}

    writer = _PrunedModelWriter(adapter, student_state, new_config, report)
    write_model(model_dir, out_dir, writer, overwrite=overwrite, progress=progress)
    model = student = teacher = None  # free both models before evaluation loads two more
    if eval_data:
        report["eval"] = evaluation_report(
            out_dir, eval_data, seq_len=seq_len, max_tokens=eval_tokens, reference_dir=model_dir, progress=progress
        )
    update_report(out_dir, report)
    return report


class _PrunedModelWriter(LayerPass):
    """Writes the pruned model (:func:`~moecompress.runner.pipeline.write_model`): the input with every layer's
    attention and norm tensors taken from the pruned (and distilled) model, cast back to their on-disk dtype, and
    config.json with the new head counts."""

    name = "prune_heads"

    def __init__(
        self, adapter: FamilyAdapter, student_state: dict[str, torch.Tensor], config: dict, report: dict[str, Any]
    ):
        super().__init__(None)
        self.adapter, self.student_state, self.new_config, self.written = adapter, student_state, config, report

    def rewrite_rest(self, layer: int, rest: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        prefix = self.adapter.layer_prefix(layer)
        replaced = {}
        for key, tensor in rest.items():
            if self.adapter.classify_key(key) in ("attention", "norms"):
                runtime = prefix + self.adapter.runtime_local_key(layer, key)
                replaced[key] = self.student_state[runtime].to(tensor.dtype).contiguous()
            else:
                replaced[key] = tensor
        return replaced

    def finish_config(self, config: dict[str, Any]) -> dict[str, Any]:
        return self.new_config

    def report(self) -> dict[str, Any]:
        return self.written
