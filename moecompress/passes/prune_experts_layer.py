"""Expert pruning as a layer pass of the pipeline (:mod:`moecompress.runner.pipeline`), built on
:mod:`moecompress.passes.prune_experts` (scores, the choice of removals, the report)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch

from ..checkpoint import CheckpointReader
from ..checkpoint.decode import describe_input, native_refusal, quant_method
from ..checkpoint.mtp import mtp_layers
from ..checkpoint.stream import layer_unit
from ..errors import UserInputError
from ..families import FamilyAdapter, MoEWeights
from ..sweep.engine import LayerCapture
from ..sweep.state import LayerResult
from .base import LayerPass, Needs, PassContext
from .maep_weights import pipeline_token_weights
from .mtp_plans import plan_stored_prune
from .prune_experts import (
    LayerScores,
    PruneExpertsConfig,
    PrunePlan,
    choose_removals,
    group_limit,
    plan_pruning,
    score_layer,
)


class PruneExpertsPass(LayerPass):
    """Expert pruning in the pipeline: scores every expert in the measuring sweep (on the original model, as the
    one-pass ``prune`` does, so that both scopes rank on the same footing), chooses the removals from all layers'
    scores, and in the rewriting sweep slices each block to its kept experts, or merges each group of experts into
    one (``merge``), then refits the router on the layer's calibration inputs (``recalibrate_router``)."""

    name = "prune_experts"

    def __init__(self, config: PruneExpertsConfig):
        super().__init__(config)
        self.layer_scores: list[LayerScores] = []
        self.plan: PrunePlan | None = None
        self._adapter: FamilyAdapter | None = None
        self._token_weights: dict[int, torch.Tensor] = {}
        self._stored = None
        self._layer_decides_alone = False
        self.rewrites: dict[str, dict[str, Any]] = {}
        """Per written unit, what merging and the router refit did there (the journal keeps it for a resume)."""

    def needs(self) -> Needs:
        config = self.config
        merge = config.method == "merge"
        steps = ["merge each group of alike experts into one" if merge else "remove the chosen experts"]
        if config.recalibrate_router:
            steps.append("refit the router")
        return Needs(
            measuring=f"{config.method} expert scores" + (" and merge trees" if merge else ""),
            calibration=config.rewrites_from_calibration,
            attention=config.method == "maep" and bool(config.prune_tags),
            sensitivity="fisher-token" if config.method == "maep" and config.token_weight == "fisher" else None,
            sequential=True,
            weights_only=True,
            rewrites=f"{', then '.join(steps)} ({config.scope} scope)",
        )

    def prepare(self, context: PassContext) -> None:
        config = self.config
        config.validate()
        adapter = context.adapter
        native_refusal(adapter.config, str(context.model_dir))
        self._adapter = adapter
        self._token_weights = pipeline_token_weights(self.config, context)
        self._layer_decides_alone = self.config.scope == "layer" and self.config.method != "merge"
        if self._layer_decides_alone:
            adapter = context.adapter
            with CheckpointReader(context.model_dir, decode=False) as reader:
                mtp = mtp_layers(adapter, reader.keys()) if self.config.mtp == "keep" else []
            scored = adapter.moe_layers() + mtp
            self._layer_decides_alone = len({adapter.experts_in_layer(layer) for layer in scored}) == 1

    def measure(self, capture: LayerCapture) -> LayerResult:
        return score_layer(self._adapter, capture, self.config, self._token_weights.get(capture.layer)).to_result()

    def absorb(self, layer: int, result: LayerResult) -> None:
        self.layer_scores.append(LayerScores.from_result(result))

    def keeps(self, layer: int) -> list[int] | None:
        """With ``scope: layer`` (not merging) and every scored layer holding as many experts, each layer loses the
        same count, chosen from its own scores: :func:`choose_removals` of that layer alone gives what
        :meth:`decide` gives it whenever the whole plan is valid (``round(r·E·L) / L`` whole implies it equals
        ``round(r·E)``)."""
        if not self._layer_decides_alone:
            return None
        scores = next((s for s in reversed(self.layer_scores) if s.layer == layer), None)
        if scores is None:
            return None
        try:
            adapter = self._adapter
            removed = set(choose_removals([scores], self.config, adapter.top_k, group_limit(adapter))[layer])
        except UserInputError:
            return None
        return [e for e in range(len(scores.expert_ids)) if e not in removed]

    def decide(self, context: PassContext) -> None:
        from ..families import adapter_for

        data = context.calibration
        calibration = {
            "source": data.source,
            "tokens": int(data.tags.numel()),
            "seq_len": data.seq_len,
            "seed": self.config.seed,
            "tags": data.tag_names,
            "tag_counts": torch.bincount(data.tags, minlength=len(data.tag_names)).tolist(),
        }
        self.plan = plan_pruning(context.model_dir, context.adapter, self.layer_scores, self.config, calibration)
        stored = plan_stored_prune(
            context.model_dir,
            context.adapter,
            self.plan.keep_positions,
            self.plan.config,
            self.config.mtp,
            group_limit(context.adapter),
        )
        self.plan.keep_positions, self.plan.config = stored.keep_positions, stored.config
        self._stored = None if self.config.rewrites_from_calibration else stored.raw_layer_fn
        if stored.report:
            self.plan.report["mtp"] = stored.report
        self.plan.report["input_format"] = describe_input(context.model_dir)
        context.extra["drop_layers"] = context.extra.get("drop_layers", frozenset()) | stored.drop_layers
        context.extra["drop_keys"] = context.extra.get("drop_keys", frozenset()) | stored.drop_keys
        context.kept_positions = self.plan.keep_positions
        context.adapter = adapter_for(self.plan.config, source=str(context.model_dir))

    def rewrite(self, layer: int, block: Any, capture: LayerCapture | None) -> Any:
        keep = self.plan.keep_positions
        if block is None or layer not in keep:
            return block
        attention = self.plan.attention_keep_positions.get(layer)
        if capture is not None and attention is not None:
            allowed = torch.zeros(len(self._adapter.original_attention_expert_ids(layer)), dtype=torch.bool)
            allowed[attention] = True
            capture.extra["attention_allowed"] = allowed
        if not self.config.rewrites_from_calibration:
            return block.select(keep[layer])
        if capture is None:
            raise RuntimeError(f"layer {layer}: merging and router recalibration need the layer's calibration inputs")
        done: dict[str, Any] = {}
        groups = (self.plan.merge_groups or {}).get(layer)
        if groups is None:
            rewritten = block.select(keep[layer])
        else:
            from .expert_merge import merge_experts

            rewritten, done["merge"] = merge_experts(
                self._adapter,
                block,
                groups,
                capture.moe_input,
                router_input=capture.router_input,
                token_ids=capture.token_ids,
                sequence_lengths=capture.sequence_lengths,
            )
            rewritten = replace(rewritten, expert_ids=[block.expert_ids[group[0]] for group in groups])
        if self.config.recalibrate_router:
            from .router_refit import recalibrate_router

            rewritten, done["router"] = recalibrate_router(
                self._adapter,
                block,
                rewritten,
                capture.moe_input,
                router_input=capture.router_input,
                token_ids=capture.token_ids,
                sequence_lengths=capture.sequence_lengths,
            )
        self.rewrites[layer_unit(layer)] = done
        return _in_dtypes_of(rewritten, block)

    def rewrite_rest(self, layer: int, rest: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        keep = self.plan.attention_keep_positions.get(layer)
        return rest if keep is None else self._adapter.select_attention_experts(layer, rest, keep)

    def unit_meta(self, unit: str) -> Any:
        return self.rewrites.get(unit)

    def restore(self, unit: str, entry: Any) -> None:
        self.rewrites[unit] = entry

    def stored_rewrite(self):
        """Plain removal from a quantised release: the kept experts' stored blocks, copied (and the attention's
        kept experts where it has its own)."""
        if self._stored is None or not self.plan.attention_keep_positions:
            return self._stored
        stored = self._stored

        def rewrite(layer: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return self.rewrite_rest(layer, stored(layer, tensors))

        return rewrite

    def finish_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The pruned config. A quantised release's ``quantization_config`` stays where its kept experts are copied
        as stored, and goes where the pipeline writes every tensor decoded (merged experts and refitted routers are
        new weights, not copies of stored blocks)."""
        pruned = copy.deepcopy(self.plan.config)
        method = quant_method(pruned)
        if method is not None and self._stored is None:
            for section in [pruned, *(v for v in pruned.values() if isinstance(v, dict))]:
                section.pop("quantization_config", None)
            dtype = pruned.get("torch_dtype") or pruned.get("dtype") or "its compute dtype"
            self.plan.report["written_decoded"] = (
                f"the input is a {method} release; every tensor is written decoded ({dtype}) and the output has no "
                "quantization_config"
            )
        return pruned

    def report(self) -> dict[str, Any]:
        report = self.plan.report
        for unit, done in sorted(self.rewrites.items()):
            layer = report["layers"].get(unit.removeprefix("layer-"))
            if layer is not None:
                layer.update(
                    {("merge_groups" if key == "merge" else "router_refit"): value for key, value in done.items()}
                )
        return report


def _in_dtypes_of(block: MoEWeights, original: MoEWeights) -> MoEWeights:
    """``block``'s tensors in the dtypes the original layer stores, so the output keeps the input's layout."""
    changes = {}
    for name in MoEWeights.EXPERT_TENSORS + MoEWeights.ROUTER_TENSORS:
        tensor, stored = getattr(block, name), getattr(original, name)
        if tensor is not None and stored is not None and tensor.dtype != stored.dtype:
            changes[name] = tensor.to(stored.dtype)
    return replace(block, **changes) if changes else block
