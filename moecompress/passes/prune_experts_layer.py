"""Expert pruning as a layer pass of the pipeline (:mod:`moecompress.pipeline`), built on
:mod:`moecompress.passes.prune_experts` (scores, the choice of removals, the report)."""

from __future__ import annotations

from typing import Any

import torch

from ..checkpoint.decode import describe_input
from ..checkpoint.mtp import plan_stored_prune
from ..families import FamilyAdapter
from ..sweep import LayerCapture
from ..sweep_state import LayerResult
from .base import LayerPass, Needs, PassContext
from .prune_experts import LayerScores, PruneExpertsConfig, PrunePlan, group_limit, plan_pruning, score_layer


class PruneExpertsPass(LayerPass):
    """Expert pruning in the pipeline: scores every expert in the measuring sweep (on the original model, as the
    one-pass ``prune`` does, so that both scopes rank on the same footing), chooses the removals from all layers'
    scores, and in the rewriting sweep slices each block to its kept experts."""

    name = "prune_experts"

    def __init__(self, config: PruneExpertsConfig):
        super().__init__(config)
        self.layer_scores: list[LayerScores] = []
        self.plan: PrunePlan | None = None
        self._adapter: FamilyAdapter | None = None

    def needs(self) -> Needs:
        config = self.config
        return Needs(
            measuring=f"{config.method} expert scores",
            attention=config.method == "maep" and bool(config.prune_tags),
            sequential=True,
            weights_only=True,
            rewrites=f"remove the chosen experts ({config.scope} scope)",
        )

    def prepare(self, context: PassContext) -> None:
        self.config.validate()
        self._adapter = context.adapter

    def measure(self, capture: LayerCapture) -> LayerResult:
        return score_layer(self._adapter, capture, self.config).to_result()

    def absorb(self, layer: int, result: LayerResult) -> None:
        self.layer_scores.append(LayerScores.from_result(result))

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
        if stored.report:
            self.plan.report["mtp"] = stored.report
        self.plan.report["input_format"] = describe_input(context.model_dir)
        context.extra["drop_layers"] = context.extra.get("drop_layers", frozenset()) | stored.drop_layers
        context.extra["drop_keys"] = context.extra.get("drop_keys", frozenset()) | stored.drop_keys
        context.kept_positions = self.plan.keep_positions
        context.adapter = adapter_for(self.plan.config, source=str(context.model_dir))

    def rewrite(self, layer: int, block: Any, capture: LayerCapture | None) -> Any:
        keep = self.plan.keep_positions
        return block.select(keep[layer]) if block is not None and layer in keep else block

    def finish_config(self, config: dict[str, Any]) -> dict[str, Any]:
        return self.plan.config

    def report(self) -> dict[str, Any]:
        return self.plan.report
