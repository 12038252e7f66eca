"""The pass protocol: what the pipeline (:mod:`moecompress.runner.pipeline`) asks of a pass.

A *layer pass* works on one decoder layer at a time inside the pipeline's sweeps:

1. :meth:`LayerPass.needs` says what it needs from calibration (routed inputs, attention received, a downstream
   sensitivity, a measuring sweep for a global decision) before any work, so the pipeline can plan its sweeps;
2. :meth:`LayerPass.prepare` runs before the sweeps (the low-rank sensitivity's forward + backward);
3. :meth:`LayerPass.measure` gets each layer's capture in the one measuring sweep and returns what a resumed run
   needs of it; :meth:`LayerPass.absorb` takes that result (fresh or restored from the sweep's state);
4. :meth:`LayerPass.decide` makes the global decisions from every layer's measurements (expert ranking, the
   rank budget) and may change the model view later passes see (:class:`PassContext`);
5. :meth:`LayerPass.rewrite` turns a layer's MoE block into its rewritten form in the rewriting sweep, in recipe
   order; the last pass that :attr:`~LayerPass.writes_layers` lays the layer's tensors out
   (:meth:`LayerPass.write_layer`);
6. :meth:`LayerPass.unit_meta` is the pass's journal entry for a written unit, handed back by
   :meth:`LayerPass.restore` when a resumed run keeps that unit;
7. :meth:`LayerPass.finish_config` and :meth:`LayerPass.report` complete the output.

A *whole-model pass* (``qat``, ``prune_heads``) runs on a whole checkpoint and writes one: the pipeline runs it on
the result of the layer passes before it. Both kinds are listed in :mod:`moecompress.passes.registry`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..families import FamilyAdapter
from ..sweep.engine import LayerCapture
from ..sweep.state import LayerResult


@dataclass(frozen=True)
class Needs:
    """What a layer pass needs from the pipeline; decided from its config alone (``--dry-run`` prints the plan)."""

    measuring: str | None = None
    """What it measures in the measuring sweep for a global decision (None: it needs no measuring sweep)."""
    calibration: bool = False
    """Routed calibration inputs in the rewriting sweep (GPTQ, salient weights, low-rank adapters)."""
    attention: bool = False
    """The attention each token receives (eager attention in the sweeps)."""
    sensitivity: str | None = None
    """A downstream sensitivity mode, computed by a forward + backward sweep before the measuring sweep."""
    sequential: bool = False
    """Later layers should calibrate on this pass's rewritten block rather than on the original one."""
    weights_only: bool = False
    """Its measurement only reads the block's weights, so the measuring sweep may hold them in the compute dtype."""
    rewrites: str = ""
    """What it does to a layer in the rewriting sweep, for the plan."""


@dataclass
class CalibrationData:
    """The calibration windows every sweep of a pipeline run shares."""

    batches: list[dict[str, torch.Tensor]]
    tags: torch.Tensor
    tag_names: list[str]
    source: str
    seq_len: int
    seed: int


@dataclass
class PassContext:
    """What the pipeline hands its passes; :meth:`LayerPass.decide` may replace ``adapter`` (the model view the
    following passes see, e.g. with fewer experts) and record the experts each layer keeps."""

    model_dir: Path
    adapter: FamilyAdapter
    calibration: CalibrationData | None
    state_dir: Path | None
    """The run's resumable state (None on a torchrun rank other than 0, which keeps none)."""
    progress: bool = True
    out_dir: Path | None = None
    sensitivities: dict[str, str] = field(default_factory=dict)
    """Per pass of the stage, the downstream sensitivity it asks for (:attr:`Needs.sensitivity`), so that passes
    needing the same one share it."""
    kept_positions: dict[int, list[int]] | None = None
    """Per MoE layer, the positions (in the input's block) of the experts that survive pruning."""
    extra: dict[str, Any] = field(default_factory=dict)


class LayerPass:
    """Base class of the passes the pipeline applies layer by layer; the defaults do nothing."""

    name: ClassVar[str]
    writes_layers: ClassVar[bool] = False
    """Whether :meth:`write_layer` lays layers out (else the family's own layout of a plain block is used)."""

    def __init__(self, config: Any):
        self.config = config

    def needs(self) -> Needs:
        return Needs()

    def prepare(self, context: PassContext) -> None:
        """Checks against the input and work before the sweeps."""

    def measure(self, capture: LayerCapture) -> LayerResult | None:
        return None

    def absorb(self, layer: int, result: LayerResult) -> None:
        """Take one layer's measurement (just measured, or restored by a resumed run)."""

    def keeps(self, layer: int) -> list[int] | None:
        """The positions of the experts layer ``layer`` keeps after this pass, when its measurement of that layer
        alone decides them (None: known only at :meth:`decide`, or nothing removed); later passes then measure only
        those experts."""
        return None

    def decide(self, context: PassContext) -> None:
        """Global decisions from every layer's measurements."""

    def attach_sweep(self, sweep: Any) -> None:
        """The rewriting sweep (a :class:`~moecompress.sweep.engine.CalibrationSweep`) before it runs, for a pass that
        hooks the stock modules of its model."""

    def rewrite(self, layer: int, block: Any, capture: LayerCapture | None) -> Any:
        """Layer ``layer``'s MoE block after this pass (``capture`` is None when the sweep does not calibrate)."""
        return block

    def rewrite_rest(self, layer: int, rest: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s tensors outside its MoE block (attention, norms), by their stored names, after this pass
        in the rewriting sweep: unchanged unless the pass rewrites them (JetMoE's attention experts, pruned heads)."""
        return rest

    def write_layer(self, layer: int, block: Any, rest: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{self.name} does not lay layers out")

    def stored_rewrite(self) -> Callable[[int, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None:
        """A function rewriting a layer's tensors as stored (a quantised release's codes and scales, not decoded),
        where the pass can: an uncalibrated stage whose passes all give one copies the input as stored."""
        return None

    def write_outside(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return tensors

    def unit_meta(self, unit: str) -> Any:
        return None

    def restore(self, unit: str, entry: Any) -> None:
        """Take back the journal entry of a unit a resumed run keeps."""

    def finish_config(self, config: dict[str, Any]) -> dict[str, Any]:
        return config

    def report(self) -> dict[str, Any]:
        return {"pass": self.name}

    def finished(self, out_dir: Path) -> None:
        """Add what can only be measured on the written output to the report."""


@dataclass(frozen=True)
class InputFacts:
    """What a pass config's optional ``check_input(facts)`` checks before any work: the input as its config.json
    and safetensors headers describe it (nothing heavier is read)."""

    model_dir: Path
    adapter: FamilyAdapter
    quantized: str | None
    """The input's ``quant_method`` where it is quantised."""
    experts_removed: bool = False
    """An earlier pass of the run removes experts, so config.json no longer gives this pass's expert counts."""


@dataclass(frozen=True)
class PassEntry:
    """One registered pass: its config dataclass and either a layer pass class or a whole-model function
    ``run(source, target, config, *, calibration, evaluation, overwrite, progress) -> report`` (``calibration``
    and ``evaluation``: the recipe's :class:`~moecompress.runner.recipes.Calibration` and
    :class:`~moecompress.runner.recipes.Evaluation` or None), which
    :func:`~moecompress.runner.pipeline.run_whole_model_pass` calls."""

    name: str
    config: type
    layer_pass: type[LayerPass] | None = None
    run_whole_model: Callable[..., dict[str, Any]] | None = None
    help: str = ""
    headline: tuple[str, ...] = ()
    """The parameters a plan line always shows, default or not (every other one shows where it differs)."""
    quantizes: bool = False
    """It quantises the model: no later pass may quantise it again or prune it."""
    prunes: bool = False
    """It removes parts of the model, so it must come before any pass that :attr:`quantizes`."""
    removes_experts: bool = False
    """It removes routed experts: the passes after it cannot take the expert counts from the input's config.json."""
    shares_ranks: bool = False
    """Under ``torchrun`` a recipe of this pass alone shares its calibration over the ranks."""
    card_tags: tuple[str, ...] = ()
    """The model card's tags for an output this pass made (besides a quantising pass's ``quantized``)."""

    @property
    def kind(self) -> str:
        return "layer" if self.layer_pass is not None else "model"
