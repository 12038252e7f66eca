"""Expert pruning: score every routed expert on calibration data, choose which to remove, slice the checkpoint.

Methods:
- ``maep``: Delta-H output importance (the block's output change when the expert is removed and its tokens are
  re-routed), made modality- or domain-aware with token tags: tokens whose tag is in ``preserve_tags`` give a
  preservation signal; the ``low_attention_fraction`` of ``prune_tags`` tokens that receive the least attention
  give a pruning signal. score = mean ΔH over preservation tokens − ``prune_weight`` × mean ΔH over pruning
  tokens. Without tags every token preserves. Each token's ΔH is weighted by what an error at the block's output
  costs the loss there (``token_weight``, :mod:`.maep_weights`).
- ``reap``: mean over routed tokens of gate weight × ‖expert output‖ (REAP).
- ``frequency``: fraction of tokens whose top-k holds the expert.
- ``random``: seeded uniform scores.
- ``merge``: instead of removing experts, groups of experts whose outputs on the calibration tokens are alike are
  merged into one expert each (:mod:`moecompress.passes.expert_merge`); how many each layer keeps follows the scope
  (global scope ranks by the MAEP score).

``recalibrate_router`` refits the surviving router rows on the calibration tokens so the compressed layer's output
reproduces the original layer's (:mod:`moecompress.passes.router_refit`). Merging and recalibration change weights
from calibration inputs, so they run in the pipeline's calibrated rewriting sweep (:mod:`moecompress.runner.pipeline`).

``scope="layer"`` removes the same number from every MoE layer; ``scope="global"`` ranks all experts of all
layers together after dividing each layer's scores by the layer's mean expert score, so counts may differ by
layer, and never goes below ``min_keep`` (at least top-k) in any layer.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..calibration import distributed
from ..checkpoint.mtp import MTP_MODES
from ..defaults import (
    DEFAULT_CALIB_TOKENS,
    DEFAULT_DATA,
    DEFAULT_EVAL_TOKENS,
    DEFAULT_IMAGE_SIZE,
    DEFAULT_SEQ_LEN,
    SCOPES,
)
from ..errors import OptionError, UserInputError
from ..families import FamilyAdapter
from ..sweep.engine import LayerCapture
from ..sweep.state import LayerResult
from ..vocabulary import named
from .base import InputFacts
from .expert_scores import layer_expert_stats
from .maep_weights import TOKEN_WEIGHTS
from .options import When, check_declared, option, recipe_only

METHODS: tuple[str, ...] = ("maep", "reap", "frequency", "random", "merge")
AGGREGATES: tuple[str, ...] = ("mean_sq", "mean")
DEFAULT_RATIO = 0.25
"""The share of experts removed when neither ``ratio`` nor ``keep`` is given."""
MAEP = When(named("method", "maep"), lambda c: c.method == "maep")
PRUNE_TAGS = When(f"{named('method', 'maep')} and {named('prune_tags')}", lambda c: c.method == "maep" and c.prune_tags)
GREEDY = When(f"{named('method', 'maep')} and {named('greedy', True)}", lambda c: c.method == "maep" and c.greedy)
GLOBAL = When(named("scope", "global"), lambda c: c.scope == "global")


@dataclass(frozen=True)
class PruneExpertsConfig:
    method: str = field(
        default="maep",
        metadata=option(
            "How experts are scored: MAEP Delta-H (redistribution-aware output change), REAP (gate × output norm), "
            "routing frequency, or random; or merge: experts with alike outputs on the calibration tokens merged "
            "into one (aligned, load-weighted, refitted by least squares), counts as --scope says.",
            choices=METHODS,
        ),
    )
    ratio: float | None = field(
        default=None,
        metadata=option(
            f"Fraction of routed experts removed over the whole model (default {DEFAULT_RATIO} unless --keep is "
            "given).",
            min=0,
            max=1,
            min_open=True,
            max_open=True,
        ),
    )
    keep: int | None = field(
        default=None, metadata=option("Experts kept per MoE layer (on average with --scope global).", min=1)
    )
    scope: str = field(
        default="layer",
        metadata=option(
            "layer: the same count removed from every layer (loads in every stock tool); global: experts ranked "
            "across layers, counts differ (loads in transformers after `import moecompress`).",
            choices=SCOPES,
        ),
    )
    min_keep: int | None = field(
        default=None, metadata=option("Fewest experts any layer keeps (default: top-k).", min=1, applies=GLOBAL)
    )
    preserve_tags: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "MAEP: comma-separated token tags whose outputs must be preserved (default: every tag not in "
            "--prune-tags).",
            applies=MAEP,
        ),
    )
    prune_tags: tuple[str, ...] = field(
        default=(),
        metadata=option(
            "MAEP: comma-separated tags whose low-attention tokens are a pruning signal (e.g. vision, or prose "
            "when preserving code).",
            applies=MAEP,
        ),
    )
    low_attention_fraction: float = field(
        default=0.5,
        metadata=option(
            "MAEP: share of --prune-tags tokens, lowest by attention received, that form the pruning signal.",
            min=0,
            max=1,
            min_open=True,
            applies=PRUNE_TAGS,
        ),
    )
    prune_weight: float = field(
        default=0.5,
        metadata=option("MAEP: weight of the pruning signal against the preservation signal.", applies=PRUNE_TAGS),
    )
    aggregate: str = field(
        default="mean_sq",
        metadata=option(
            "MAEP: average ‖ΔH‖² (the expected squared output error) or ‖ΔH‖ over tokens.",
            choices=AGGREGATES,
            applies=MAEP,
        ),
    )
    token_weight: str = field(
        default="fisher",
        metadata=option(
            "MAEP: weight each token's ‖ΔH‖² by how much an error at the block's output there costs the loss "
            "(fisher: ‖∂loss/∂output‖², one extra forward and backward sweep) or not at all (none).",
            choices=TOKEN_WEIGHTS,
            applies=MAEP,
        ),
    )
    greedy: bool = field(
        default=False,
        metadata=option(
            "MAEP: remove experts step by step, re-scoring the survivors with the removed ones gone (slower).",
            applies=MAEP,
        ),
    )
    greedy_step: int | None = field(
        default=None,
        metadata=recipe_only(
            "Greedy MAEP: experts removed per re-scoring step (default: a sixteenth of the layer's).",
            min=1,
            applies=GREEDY,
        ),
    )
    recalibrate_router: bool = field(
        default=False,
        metadata=option(
            "Refit each layer's surviving router rows (and biases) so the compressed layer reproduces the original "
            "layer's output on the calibration tokens (a few distillation steps per layer, in the layer sweep)."
        ),
    )
    seed: int = field(default=0, metadata=option("Seed for calibration windows and --method random."))
    mtp: str = field(
        default="keep",
        metadata=option(
            "Multi-token-prediction layers (DeepSeek-V3/R1, Kimi-K2, GLM-4.5 layer num_hidden_layers; Qwen3-Next, "
            "Qwen3.5 mtp.*): keep (calibrated on the inputs the MTP module computes and pruned like the main "
            "layers) or drop (not written, the MTP layer count 0).",
            choices=MTP_MODES,
        ),
    )

    def __post_init__(self) -> None:
        if self.ratio is None and self.keep is None:
            object.__setattr__(self, "ratio", DEFAULT_RATIO)

    def validate(self) -> None:
        def refuse(template: str) -> OptionError:
            return OptionError(template, PruneExpertsConfig)

        check_declared(self)
        if (self.ratio is None) == (self.keep is None):
            raise refuse(f"give exactly one of {named('ratio')} and {named('keep')}")

    def check_input(self, facts: InputFacts) -> None:
        """Refuse an input this pass cannot prune, and counts its layers cannot keep (where config.json still gives
        them), before any work."""
        from ..checkpoint.decode import native_refusal
        from ..runner.preflight import check_prune_counts, check_router_sizes

        if facts.quantized:
            native_refusal(facts.adapter.config, str(facts.model_dir))
        facts.adapter.check_expert_pruning(str(facts.model_dir), self)
        linear = [layer for layer in facts.adapter.moe_layers() if not facts.adapter.softmax_attention(layer)]
        if self.method == "maep" and self.prune_tags and linear:
            raise OptionError(
                f"{facts.model_dir}: {named('prune_tags')} needs the attention each token receives, and MoE "
                f"layers {linear} of this {facts.adapter.family} model use linear attention; use "
                f"{named('preserve_tags')} alone",
                PruneExpertsConfig,
            )
        if not facts.experts_removed:
            check_router_sizes(facts.model_dir, facts.adapter)
            check_prune_counts(facts.adapter, self)

    @property
    def rewrites_from_calibration(self) -> bool:
        """Whether the rewrite computes new weights from calibration inputs (merging, router refit), which the
        pipeline's calibrated rewriting sweep provides; plain removal only slices."""
        return self.method == "merge" or self.recalibrate_router


@dataclass
class LayerScores:
    """Everything measured for one layer, kept for the report and for the selection."""

    layer: int
    expert_ids: list[int]
    score: torch.Tensor
    frequency: torch.Tensor
    reap: torch.Tensor
    delta_h: torch.Tensor
    extra: dict[str, Any] = field(default_factory=dict)
    removal_order: list[int] | None = None
    removal_scores: list[float] | None = None
    identity_frequency: list[float] | None = None
    """Share of tokens routed to each identity expert (LongCat-Flash); they are never candidates for removal."""
    merge_tree: list[list[int]] | None = None
    """``--method merge``: the layer's agglomerative merges of experts by output similarity, cut at decision time."""
    attention_load: list[float] | None = None
    """Where the attention has experts of its own (:attr:`FamilyAdapter.attention_experts`): the mean gate weight per
    token its router gives each of them; the layer keeps as many of them as of its MLP experts, the highest."""

    def to_result(self) -> LayerResult:
        """The scores as a sweep state keeps them for a resumed run (tensors exact, the rest JSON)."""
        tensors = {"score": self.score, "frequency": self.frequency, "reap": self.reap, "delta_h": self.delta_h}
        meta = {
            "layer": self.layer,
            "expert_ids": self.expert_ids,
            "extra": self.extra,
            "removal_order": self.removal_order,
            "removal_scores": self.removal_scores,
            "identity_frequency": self.identity_frequency,
            "merge_tree": self.merge_tree,
            "attention_load": self.attention_load,
        }
        return tensors, meta

    @classmethod
    def from_result(cls, result: LayerResult) -> LayerScores:
        tensors, meta = result
        return cls(**meta, **tensors)


def _tag_mask(capture: LayerCapture, tags: tuple[str, ...]) -> torch.Tensor:
    wanted = [i for i, name in enumerate(capture.tag_names) if name in tags]
    return torch.isin(capture.tags, torch.tensor(wanted, dtype=torch.long, device=capture.tags.device))


def score_layer(
    adapter: FamilyAdapter,
    capture: LayerCapture,
    config: PruneExpertsConfig,
    token_weight: torch.Tensor | None = None,
) -> LayerScores:
    """The chosen method's score of every expert in one layer (higher = more important); MAEP weighs each token's
    ‖ΔH‖² by ``token_weight`` ``[T]`` where given (:mod:`.maep_weights`).

    Under ``torch.distributed`` the capture holds this rank's tokens only; every statistic is then a sum and
    a count added over ranks, so all ranks get the scores of the whole calibration set."""
    stats = layer_expert_stats(
        adapter,
        capture.moe,
        capture.moe_input,
        router_input=capture.router_input,
        token_ids=capture.token_ids,
        sequence_lengths=capture.sequence_lengths,
    )
    tokens, counts, reap_sum, delta_h_sum = distributed.sum_over_ranks(
        torch.tensor(float(stats.delta_h.shape[0]), device="cpu"),
        stats.routed_counts,
        stats.reap_sum,
        stats.delta_h.double().sum(dim=0),
    )
    extra: dict[str, Any] = {}
    frequency = (counts / tokens).float()
    reap = torch.where(counts > 0, reap_sum / counts.clamp_min(1), 0.0).float()
    if config.method == "frequency":
        score = frequency
    elif config.method == "reap":
        score = reap
    elif config.method == "random":
        generator = torch.Generator(device="cpu").manual_seed(config.seed * 100_003 + capture.layer)
        score = torch.rand(capture.moe.num_experts, generator=generator, device="cpu")
    else:
        score, extra = _maep_score(stats.delta_h, capture, config, token_weight)
    score = adapter.scores_without_tokens(capture.moe, score, counts[: capture.moe.num_experts])
    merges = None
    if config.method == "merge":
        from .expert_merge import expert_signatures, merge_tree

        signatures = expert_signatures(adapter, capture.moe, capture.moe_input, router_input=capture.router_input)
        group_size = router_group_size(adapter, capture.moe.num_experts)
        merges = [list(pair) for pair in merge_tree(signatures, group_size=group_size)]
    scores = LayerScores(
        layer=capture.layer,
        expert_ids=list(capture.moe.expert_ids),
        score=score,
        frequency=frequency,
        reap=reap,
        delta_h=(delta_h_sum / tokens).float(),
        extra=extra,
        merge_tree=merges,
    )
    if stats.identity_counts is not None:
        (identity_counts,) = distributed.sum_over_ranks(stats.identity_counts)
        scores.identity_frequency = (identity_counts / tokens).tolist()
    if "attention_expert_load" in capture.extra:
        (attention_load,) = distributed.sum_over_ranks(capture.extra["attention_expert_load"])
        scores.attention_load = (attention_load / tokens).tolist()
    if config.method == "maep" and config.greedy:
        scores.removal_order, scores.removal_scores = _greedy_removal_order(
            adapter, capture, config, score, token_weight
        )
    return scores


def _greedy_removal_order(
    adapter: FamilyAdapter,
    capture: LayerCapture,
    config: PruneExpertsConfig,
    first_scores: torch.Tensor,
    token_weight: torch.Tensor | None = None,
) -> tuple[list[int], list[float]]:
    """Remove experts one step at a time, re-scoring the survivors against the reduced block each time.

    One-shot ΔH scores each expert as if it alone were removed; removing several at once can take away a
    token's replacement expert too. The greedy order accounts for that: each step's ΔH is measured with the
    experts removed so far already gone. Returns the removal order (down to the layer minimum) and each
    removal's score at the time it was removed.
    """
    num_experts = capture.moe.num_experts
    step = config.greedy_step or max(1, num_experts // 16)
    floor = max(adapter.top_k, config.min_keep or adapter.top_k)
    removed = torch.zeros(num_experts, dtype=torch.bool, device="cpu")
    order: list[int] = []
    marginal: list[float] = []
    score = first_scores
    while num_experts - len(order) > floor:
        candidates = sorted((float(score[e]), e) for e in range(num_experts) if not removed[e])
        for value, expert in candidates[: min(step, num_experts - len(order) - floor)]:
            order.append(expert)
            marginal.append(value)
            removed[expert] = True
        if num_experts - len(order) > floor:
            stats = layer_expert_stats(
                adapter,
                capture.moe,
                capture.moe_input,
                removed=removed,
                router_input=capture.router_input,
                token_ids=capture.token_ids,
                sequence_lengths=capture.sequence_lengths,
            )
            score, _ = _maep_score(stats.delta_h, capture, config, token_weight)
    return order, marginal


def _aggregate(
    delta_h: torch.Tensor,
    masks: list[torch.Tensor],
    config: PruneExpertsConfig,
    token_weight: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], list[int]]:
    """Per mask and expert, the mean over the masked tokens of all ranks of ‖ΔH‖² (the expected squared output
    error; default) or of ‖ΔH‖, each token's value multiplied by its ``token_weight`` where given, and the masks'
    global token counts. A mask without any token gives zeros."""
    values = (delta_h.double() ** 2) if config.aggregate == "mean_sq" else delta_h.double()
    if token_weight is not None:
        values = values * token_weight.to(values.device).double()[:, None]
    sums = [values[mask.to(values.device)].sum(dim=0) for mask in masks]
    counts = [torch.tensor(float(mask.sum()), device="cpu") for mask in masks]
    totals = distributed.sum_over_ranks(*sums, *counts)
    sums, counts = totals[: len(masks)], [int(count) for count in totals[len(masks) :]]
    means = [
        (total / n).float() if n else torch.zeros(delta_h.shape[1], device="cpu")
        for total, n in zip(sums, counts, strict=True)
    ]
    return means, counts


def _lowest_attention(capture: LayerCapture, candidates: torch.Tensor, fraction: float) -> torch.Tensor:
    """Mask of the ``fraction`` of candidate tokens, over all ranks, that receive the least attention (ties to the
    earlier token). The candidates' values are gathered in rank order, which is the single-process token order,
    so every rank picks exactly what one process would."""
    if capture.attention_received is None:
        raise RuntimeError("MAEP with prune tags needs the attention each token receives")
    received, sizes = distributed.gather_in_rank_order(capture.attention_received[candidates].float())
    count = max(1, math.ceil(fraction * received.numel())) if received.numel() else 0
    received = received.cpu()
    chosen = torch.zeros(received.numel(), dtype=torch.bool, device="cpu")
    chosen[received.argsort(stable=True)[:count]] = True
    start = sum(sizes[: distributed.rank()])
    prune = torch.zeros_like(candidates)
    prune[candidates.nonzero().squeeze(1)] = chosen[start : start + int(candidates.sum())]
    return prune


def _maep_score(
    delta_h: torch.Tensor,
    capture: LayerCapture,
    config: PruneExpertsConfig,
    token_weight: torch.Tensor | None = None,
):
    weighting = {"token_weight": "fisher" if token_weight is not None else "none"}
    if not config.prune_tags:
        preserve = (
            _tag_mask(capture, config.preserve_tags)
            if config.preserve_tags
            else torch.ones_like(capture.tags, dtype=torch.bool)
        )
        (signal,), (tokens,) = _aggregate(delta_h, [preserve], config, token_weight)
        return signal, {"preserve_tokens": tokens, **weighting}
    candidates = _tag_mask(capture, config.prune_tags)
    preserve = _tag_mask(capture, config.preserve_tags) if config.preserve_tags else ~candidates
    prune = _lowest_attention(capture, candidates, config.low_attention_fraction)
    (preserve_signal, prune_signal), (preserve_tokens, prune_tokens) = _aggregate(
        delta_h, [preserve, prune], config, token_weight
    )
    score = preserve_signal - config.prune_weight * prune_signal
    extra = {
        "preserve_tokens": preserve_tokens,
        "prune_tokens": prune_tokens,
        "preserve_signal": preserve_signal.tolist(),
        "prune_signal": prune_signal.tolist(),
        **weighting,
    }
    return score, extra


def _normaliser(scores: LayerScores, method: str) -> float:
    magnitude = {"frequency": scores.frequency, "reap": scores.reap, "random": torch.ones_like(scores.score)}.get(
        method, torch.as_tensor(scores.extra.get("preserve_signal", scores.score), device="cpu")
    )
    value = float(magnitude.float().mean())
    return value if value > 0 else 1.0


@dataclass(frozen=True)
class GroupLimit:
    """A group-limited router's constraint: experts form ``n_group`` equal consecutive groups, the choice is
    restricted to the best ``topk_group`` groups, and a group's score needs ``min_per_group`` members."""

    n_group: int
    topk_group: int
    min_per_group: int


def group_limit(adapter: FamilyAdapter) -> GroupLimit | None:
    rule = adapter.routing_rule()
    if rule.n_group <= 1:
        return None
    return GroupLimit(rule.n_group, rule.topk_group, 2 if rule.kind == "sigmoid_group_topk" else 1)


def router_group_size(adapter: FamilyAdapter, num_experts: int) -> int | None:
    """Experts per router group of a group-limited router (None: no groups), the unit merging stays within."""
    limit = group_limit(adapter)
    return None if limit is None else num_experts // limit.n_group


def choose_removals(
    layer_scores: list[LayerScores],
    config: PruneExpertsConfig,
    top_k: int,
    groups: GroupLimit | None = None,
) -> dict[int, list[int]]:
    """Positions (within each layer) of the experts to remove."""
    sizes = {s.layer: len(s.expert_ids) for s in layer_scores}
    total = sum(sizes.values())
    if config.keep is not None:
        remove_total = total - config.keep * len(sizes)
    else:
        remove_total = round(config.ratio * total)
    min_keep = max(top_k, config.min_keep or top_k)
    if remove_total <= 0:
        chosen = named("keep", config.keep) if config.keep is not None else named("ratio", config.ratio)
        raise OptionError(f"nothing to remove: {chosen} leaves every expert", PruneExpertsConfig)
    if config.scope == "layer":
        per_layer = {layer: remove_total / len(sizes) for layer in sizes}
        if any(not n.is_integer() for n in per_layer.values()):
            raise OptionError(
                f"{named('scope', 'layer')} removes the same number from each of {len(sizes)} MoE layers; "
                f"{remove_total} experts do not split evenly (use another {named('ratio')}, {named('keep')}, or "
                f"{named('scope', 'global')})",
                PruneExpertsConfig,
            )
        removals = {}
        for scores in layer_scores:
            count = int(per_layer[scores.layer])
            if sizes[scores.layer] - count < min_keep:
                raise UserInputError(
                    f"layer {scores.layer}: would keep {sizes[scores.layer] - count} experts, "
                    f"fewer than the minimum {min_keep}"
                )
            if scores.removal_order is not None and groups is None:
                removals[scores.layer] = sorted(scores.removal_order[:count])
            else:
                removals[scores.layer] = lowest_positions(scores.score, count, groups, top_k)
        return removals
    if groups is not None:
        raise OptionError(
            f"{named('scope', 'global')} is not supported for group-limited routers (n_group > 1); use "
            f"{named('scope', 'layer')}",
            PruneExpertsConfig,
        )
    removals: dict[int, list[int]] = {layer: [] for layer in sizes}
    removed = 0
    if all(s.removal_order is not None for s in layer_scores):
        # merge the layers' greedy orders: always take the cheapest next removal over all layers
        cursor = {s.layer: 0 for s in layer_scores}
        norm = {s.layer: _normaliser(s, config.method) for s in layer_scores}
        by_layer = {s.layer: s for s in layer_scores}
        while removed < remove_total:
            options = [
                (by_layer[layer].removal_scores[i] / norm[layer], layer)
                for layer, i in cursor.items()
                if i < len(by_layer[layer].removal_order) and sizes[layer] - len(removals[layer]) > min_keep
            ]
            if not options:
                break
            _, layer = min(options)
            removals[layer].append(by_layer[layer].removal_order[cursor[layer]])
            cursor[layer] += 1
            removed += 1
    else:
        ranked = sorted(
            (float(s.score[e]) / _normaliser(s, config.method), s.layer, e)
            for s in layer_scores
            for e in range(sizes[s.layer])
        )
        for _, layer, expert in ranked:
            if removed == remove_total:
                break
            if sizes[layer] - len(removals[layer]) > min_keep:
                removals[layer].append(expert)
                removed += 1
    if removed < remove_total:
        raise UserInputError(f"cannot remove {remove_total} experts while keeping at least {min_keep} per layer")
    return {layer: sorted(pos) for layer, pos in removals.items()}


def lowest_positions(score: torch.Tensor, count: int, groups: GroupLimit | None, top_k: int) -> list[int]:
    """The ``count`` lowest-scored positions; with expert groups, the same number from every group, so the
    pruned model's groups are again equal and consecutive."""
    if groups is None:
        order = sorted(range(score.numel()), key=lambda e: (float(score[e]), e))
        return sorted(order[:count])
    size = score.numel() // groups.n_group
    keep_per_group = size - count // groups.n_group
    if count % groups.n_group or keep_per_group < groups.min_per_group or keep_per_group * groups.topk_group < top_k:
        raise UserInputError(
            f"group-limited routing (n_group={groups.n_group}, topk_group={groups.topk_group}): remove a multiple of "
            f"{groups.n_group} experts per layer, keeping at least {groups.min_per_group} per group and "
            f"{top_k} within the {groups.topk_group} chosen group(s); {count} of {score.numel()} does not"
        )
    chosen = []
    for group in range(groups.n_group):
        members = range(group * size, (group + 1) * size)
        chosen += sorted(members, key=lambda e: (float(score[e]), e))[: count // groups.n_group]
    return sorted(chosen)


def prune_experts(
    model_dir: Path,
    out_dir: Path,
    config: PruneExpertsConfig,
    *,
    calib: str = DEFAULT_DATA,
    calib_tokens: int = DEFAULT_CALIB_TOKENS,
    seq_len: int = DEFAULT_SEQ_LEN,
    image_size: int = DEFAULT_IMAGE_SIZE,
    eval_data: str | None = None,
    eval_tokens: int | None = DEFAULT_EVAL_TOKENS,
    overwrite: bool = False,
    progress: bool = True,
    resume: bool = False,
) -> dict[str, Any]:
    """Score, choose and write a pruned checkpoint (one prune_experts pass of the pipeline,
    :mod:`moecompress.runner.pipeline`); returns the report also saved as moecompress_report.json.

    With ``eval_data`` the written checkpoint is evaluated against the input (perplexity, KL, routing agreement)
    and the results join the report. With ``resume`` a killed run continues with the same bytes. Under
    ``torchrun`` the ranks share the measuring sweep and rank 0 alone writes (:func:`~moecompress.runner.pipeline.
    run_layer_passes`)."""
    from ..runner.pipeline import run_one_pass

    return run_one_pass(
        "prune_experts",
        config,
        model_dir,
        out_dir,
        calib=calib,
        calib_tokens=calib_tokens,
        seq_len=seq_len,
        image_size=image_size,
        eval_data=eval_data,
        eval_tokens=eval_tokens,
        overwrite=overwrite,
        progress=progress,
        resume=resume,
    )


@dataclass
class PrunePlan:
    """The chosen removals: per MoE layer the positions kept, the pruned model's config, and the pass's report."""

    keep_positions: dict[int, list[int]]
    config: dict[str, Any]
    report: dict[str, Any]
    merge_groups: dict[int, list[list[int]]] | None = None
    """``--method merge``: per layer, the groups of positions merged into each kept expert (anchor first)."""
    attention_keep_positions: dict[int, list[int]] = field(default_factory=dict)
    """Where the attention has experts of its own: per layer, the positions of those it keeps."""


def plan_pruning(
    model_dir: Path,
    adapter: FamilyAdapter,
    layer_scores: list[LayerScores],
    config: PruneExpertsConfig,
    calibration: dict[str, Any],
) -> PrunePlan:
    """Choose the removals from every layer's scores (a :class:`UserInputError` when they are impossible)."""
    removals = choose_removals(layer_scores, config, adapter.top_k, group_limit(adapter))
    by_layer = {s.layer: s for s in layer_scores}
    groups = None
    if config.method == "merge":
        groups = {layer: merge_groups(by_layer[layer], len(removed), adapter) for layer, removed in removals.items()}
        keep_positions = {layer: [group[0] for group in layer_groups] for layer, layer_groups in groups.items()}
        removals = {
            layer: sorted(set(range(len(by_layer[layer].expert_ids))) - set(keep_positions[layer]))
            for layer in removals
        }
    else:
        keep_positions = {
            layer: [e for e in range(len(by_layer[layer].expert_ids)) if e not in set(removed)]
            for layer, removed in removals.items()
        }
    kept_ids = {layer: [by_layer[layer].expert_ids[e] for e in pos] for layer, pos in keep_positions.items()}
    new_config = adapter.with_expert_counts({layer: len(pos) for layer, pos in keep_positions.items()}, kept_ids)
    attention_keep: dict[int, list[int]] = {}
    if adapter.attention_experts:
        attention_keep = {layer: _attention_keep(by_layer[layer], len(pos)) for layer, pos in keep_positions.items()}
        section = adapter._text_section(new_config)["moecompress"]
        section["kept_attention_experts"] = {
            str(layer): [adapter.original_attention_expert_ids(layer)[e] for e in pos]
            for layer, pos in sorted(attention_keep.items())
        }
    before = sum(len(s.expert_ids) for s in layer_scores)
    after = sum(len(pos) for pos in keep_positions.values())
    report = {
        "pass": "prune_experts",
        "config": asdict(config),
        "calibration": calibration,
        "source": str(model_dir),
        "family": adapter.family,
        "experts_before": before,
        "experts_after": after,
        "uniform": len({len(p) for p in keep_positions.values()}) == 1,
        "layers": {
            str(s.layer): {
                "kept": kept_ids[s.layer],
                "removed": [s.expert_ids[e] for e in removals[s.layer]],
                "expert_ids": s.expert_ids,
                "score": s.score.tolist(),
                "frequency": s.frequency.tolist(),
                "reap": s.reap.tolist(),
                "delta_h": s.delta_h.tolist(),
                **({"maep": s.extra} if s.extra else {}),
                **({"identity_frequency": s.identity_frequency} if s.identity_frequency is not None else {}),
                **(_attention_report(adapter, s, attention_keep[s.layer]) if s.layer in attention_keep else {}),
                **(
                    {"merged": [[s.expert_ids[e] for e in group] for group in groups[s.layer]]}
                    if groups is not None and s.layer in groups
                    else {}
                ),
            }
            for s in layer_scores
        },
    }
    return PrunePlan(keep_positions, new_config, report, groups, attention_keep)


def _attention_keep(scores: LayerScores, count: int) -> list[int]:
    """The positions of the ``count`` attention experts with the highest load (ties to the lower position)."""
    if scores.attention_load is None:
        raise RuntimeError(f"layer {scores.layer}: its attention experts' load was not measured")
    load = scores.attention_load
    return sorted(sorted(range(len(load)), key=lambda e: (-load[e], e))[:count])


def _attention_report(adapter: FamilyAdapter, scores: LayerScores, keep: list[int]) -> dict[str, Any]:
    original = adapter.original_attention_expert_ids(scores.layer)
    return {
        "attention_kept": [original[e] for e in keep],
        "attention_removed": [original[e] for e in range(len(original)) if e not in set(keep)],
        "attention_expert_ids": original,
        "attention_load": scores.attention_load,
    }


def merge_groups(scores: LayerScores, remove: int, adapter: FamilyAdapter) -> list[list[int]]:
    """The layer's merge groups when ``remove`` experts go: its merge tree cut to the kept count, each group led by
    its anchor (the member routed most often in the measuring sweep, ties to the lower position) and the groups
    ordered by anchor position, the order the merged block holds them in."""
    from .expert_merge import cut_tree

    size = len(scores.expert_ids)
    merges = [tuple(pair) for pair in scores.merge_tree]
    groups = cut_tree(merges, size, size - remove, group_size=router_group_size(adapter, size))
    led = []
    for group in groups:
        anchor = min(group, key=lambda e: (-float(scores.frequency[e]), e))
        led.append([anchor, *sorted(e for e in group if e != anchor)])
    return sorted(led, key=lambda group: group[0])
