"""The one list of passes: recipe keys and their config dataclasses, layer passes and whole-model passes.

Adding a pass: a module with its config dataclass (``validate()`` raising :class:`UserInputError`, and optionally
``check_input(facts)``, its checks against the input before any work, given
:class:`~moecompress.passes.base.InputFacts`) and either a :class:`~moecompress.passes.base.LayerPass` subclass or a
whole-model function, and one entry here. What the run needs to know of a pass (what it quantises or prunes, the
plan's headline parameters, the model card's tags) are the entry's attributes; nothing outside ``passes/`` compares
a pass's name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import PassEntry
from .prune_experts import PruneExpertsConfig
from .prune_experts_layer import PruneExpertsPass
from .prune_heads import PruneHeadsConfig
from .qat import QATConfig
from .quantize import QuantizeConfig
from .quantize_layer import QuantizePass


def _evaluated(evaluation: Any) -> dict[str, Any]:
    """A whole-model function's evaluation arguments: none, or the recipe's
    :class:`~moecompress.runner.recipes.Evaluation`."""
    if evaluation is None:
        return {"eval_data": None}
    return {"eval_data": evaluation.data, "eval_tokens": evaluation.tokens}


def _prune_heads(source: Path, target: Path, config: PruneHeadsConfig, *, calibration, evaluation, **options) -> dict:
    from .prune_heads import prune_heads

    return prune_heads(
        source,
        target,
        config,
        calib=calibration.source,
        calib_tokens=calibration.tokens,
        seq_len=calibration.seq_len,
        **_evaluated(evaluation),
        **options,
    )


def _qat(source: Path, target: Path, config: QATConfig, *, calibration, evaluation, **options) -> dict[str, Any]:
    from .qat import qat_checkpoint

    return qat_checkpoint(
        source,
        target,
        config,
        data=calibration.source,
        calib_tokens=calibration.tokens,
        **_evaluated(evaluation),
        **options,
    )


PASSES: dict[str, PassEntry] = {
    entry.name: entry
    for entry in (
        PassEntry(
            "prune_experts",
            PruneExpertsConfig,
            layer_pass=PruneExpertsPass,
            help="remove routed experts",
            headline=("method", "ratio", "keep", "scope"),
            prunes=True,
            removes_experts=True,
            shares_ranks=True,
            card_tags=("expert-pruning",),
        ),
        PassEntry(
            "prune_heads",
            PruneHeadsConfig,
            run_whole_model=_prune_heads,
            help="remove attention heads",
            headline=("ratio", "unit", "method", "scope"),
            prunes=True,
            card_tags=("head-pruning",),
        ),
        PassEntry(
            "quantize",
            QuantizeConfig,
            layer_pass=QuantizePass,
            help="quantise (and compensate) experts",
            headline=("scheme", "method", "format"),
            quantizes=True,
        ),
        PassEntry(
            "qat",
            QATConfig,
            run_whole_model=_qat,
            help="quantisation-aware training of the quantised model",
            headline=("replay", "steps"),
            quantizes=True,
            card_tags=("qat",),
        ),
    )
}
