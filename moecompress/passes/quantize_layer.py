"""Quantisation and low-rank compensation as a layer pass of the pipeline (:mod:`moecompress.runner.pipeline`), built on
:mod:`moecompress.passes.quantize` (the quantisers, the rank allocation, the per-layer rewriting work)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.decode import describe_input
from ..checkpoint.mtp import without_mtp
from ..evals.footprint import checkpoint_footprint
from ..export.imatrix import ImatrixCollector, check_imatrix_target
from ..quantization.formats import format_of
from ..quantization.sensitivity import stored_layer_sensitivity
from ..runner.preflight import data_paths
from ..sweep.state import LayerResult
from .base import LayerPass, Needs, PassContext
from .mtp_plans import quantize_mtp_plan
from .quantize import (
    QuantizeConfig,
    QuantizedLayers,
    _allocate_ranks,
    _check_format,
    _ExpertQuantizer,
    _refuse_quantized_input,
    _TensorQuantizer,
    measure_layer,
)


class QuantizePass(LayerPass):
    """Quantisation (and low-rank compensation) in the pipeline.

    With a low-rank budget it measures, in the measuring sweep, every expert matrix's error spectrum and load on
    the block as the measuring sweep sees it (before pruning: the spectra of experts a pruning pass removes are
    dropped at decision time, and the kept ones renumbered), and spends one budget over all of them. In the
    rewriting sweep it quantises the block it is given (already pruned), attaches the adapters, and lays the
    layer out in its format."""

    name = "quantize"
    writes_layers = True

    def __init__(self, config: QuantizeConfig):
        super().__init__(config)
        self.lowrank = config.lowrank_budget > 0 or config.lowrank_rank > 0
        self._gains: dict = {}
        self._loads: dict = {}
        self._shapes: dict[int, tuple] = {}
        self.layers: QuantizedLayers | None = None
        self._source = ""

    def needs(self) -> Needs:
        config = self.config
        calibrated = config.method == "gptq" or config.salient_fraction > 0
        imatrix = config.imatrix_out is not None
        rewrites = f"quantise the experts ({config.scheme}, {config.method})"
        if self.lowrank:
            rewrites += ", then add the low-rank adapters"
        if imatrix:
            rewrites += "; sum every matrix's squared inputs for the importance matrix"
        return Needs(
            measuring="quantisation error spectra of every expert matrix" if self.lowrank else None,
            calibration=calibrated or self.lowrank or imatrix,
            sensitivity=config.sensitivity if self.lowrank and config.sensitivity != "none" else None,
            sequential=calibrated,
            rewrites=rewrites,
        )

    def prepare(self, context: PassContext) -> None:
        config = self.config
        config.validate()
        adapter = context.adapter
        _refuse_quantized_input(adapter.config, context.model_dir)
        self.scheme = config.quant_scheme()
        _check_format(adapter, config, self.scheme)
        self.layout = format_of(config.format)
        self.tensors = _TensorQuantizer(adapter, self.scheme, config.targets)
        self.quantizer = _ExpertQuantizer(adapter, self.scheme, config)
        self._source = str(context.model_dir)
        if config.imatrix_out is not None:
            inputs = [context.model_dir, *data_paths(context.calibration.source)]
            check_imatrix_target(Path(config.imatrix_out), adapter, inputs, QuantizeConfig, context.out_dir)
        self._mtp = quantize_mtp_plan(context.model_dir, adapter, config.mtp, self.needs().calibration)
        context.extra["drop_layers"] = context.extra.get("drop_layers", frozenset()) | self._mtp.drop_layers
        context.extra["drop_keys"] = context.extra.get("drop_keys", frozenset()) | self._mtp.drop_keys
        if self.lowrank:
            self.quantizer.sensitivity = stored_layer_sensitivity(
                context.state_dir / "sensitivity.safetensors",
                context.model_dir,
                context.calibration.batches,
                config.sensitivity,
                context.progress,
            )

    def measure(self, capture) -> LayerResult:
        return measure_layer(self.quantizer, capture)

    def absorb(self, layer: int, result: LayerResult) -> None:
        tensors, meta = result
        for expert, which, load in meta["loads"]:
            self._gains[(layer, expert, which)] = tensors[f"{expert}.{which}"]
            self._loads[(layer, expert, which)] = load
        self._shapes[layer] = tuple(meta["shape"])

    def _kept_measurements(self, kept: dict[int, list[int]] | None) -> tuple[dict, dict, list]:
        """The measurements of the experts that survive pruning, renumbered to their positions after it (a
        layer-scope pruning's removed experts were not measured: :attr:`LayerCapture.keep`)."""
        if not kept:
            return self._gains, self._loads, list(self._shapes.values())
        gains, loads = {}, {}
        for (layer, expert, which), gain in self._gains.items():
            positions = kept.get(layer)
            if positions is None:
                new = expert
            elif expert in positions:
                new = positions.index(expert)
            else:
                continue
            gains[(layer, new, which)] = gain
            loads[(layer, new, which)] = self._loads[(layer, expert, which)]
        measured = {(layer, expert) for layer, expert, _ in self._gains}
        wanted = {(layer, e) for layer, positions in kept.items() if layer in self._shapes for e in positions}
        if missing := wanted - measured:
            raise RuntimeError(f"no spectrum measured for kept experts (layer, position) {sorted(missing)[:5]}")
        shapes = [
            (len(kept[layer]) if layer in kept else experts, *sizes)
            for layer, (experts, *sizes) in self._shapes.items()
        ]
        return gains, loads, shapes

    def decide(self, context: PassContext) -> None:
        config, adapter = self.config, context.adapter
        self.quantizer.adapter = self.tensors.adapter = adapter
        ranks: dict = {}
        lowrank_report = None
        if self.lowrank:
            ranks, lowrank_report = _allocate_ranks(config, *self._kept_measurements(context.kept_positions))
            lowrank_report["sensitivity"] = {
                str(layer): float(s.double().mean()) for layer, s in self.quantizer.sensitivity.items()
            } or None
        calibration = None
        data = context.calibration
        if self.needs().calibration:
            calibration = {
                "source": data.source,
                "tokens": int(data.tags.numel()),
                "seq_len": data.seq_len,
                "seed": config.seed,
            }
        report = {
            "pass": "quantize",
            "config": asdict(config),
            "scheme": self.scheme.to_dict(),
            "scheme_description": self.scheme.describe(),
            "source": self._source,
            "input_format": describe_input(self._source),
            "family": adapter.family,
            "calibration": calibration,
        }
        if context.kept_positions is not None:
            # A stage that prunes first lists mtp before the layers, a quantize-only one after them: the reports'
            # order before one-pass quantisation ran in the pipeline (tests/golden_outputs.json holds both).
            report["mtp"] = self._mtp.report or None
        imatrix = None
        if config.imatrix_out is not None:
            imatrix = ImatrixCollector(context.state_dir / "imatrix", adapter)
        self.layers = QuantizedLayers(report, lowrank_report, self.layout, self.tensors, self.quantizer, ranks, imatrix)
        report["mtp"] = self._mtp.report or None

    def attach_sweep(self, sweep) -> None:
        if self.layers.imatrix is not None:
            self.layers.imatrix.attach(sweep)

    def rewrite(self, layer: int, block: Any, capture) -> Any:
        return None if block is None else self.layers.quantize_moe(layer, block, capture)

    def write_layer(self, layer: int, block: Any, rest: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.layers.join_layer(layer, block, rest)

    def write_outside(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.layers.write_outside(tensors)

    def unit_meta(self, unit: str) -> Any:
        return self.layers.unit_meta(unit)

    def restore(self, unit: str, entry: Any) -> None:
        self.layers.restore(unit, entry)

    def finish_config(self, config: dict[str, Any]) -> dict[str, Any]:
        dropping = self._mtp.drop_layers or self._mtp.drop_keys
        return self.layers.finish_config(without_mtp(config) if dropping else config)

    def report(self) -> dict[str, Any]:
        return self.layers.final_report()

    def finished(self, out_dir: Path) -> None:
        report = self.layers.report
        report["footprint"] = checkpoint_footprint(Path(out_dir)).to_json()
        report["source_footprint"] = checkpoint_footprint(Path(self._source)).to_json()
