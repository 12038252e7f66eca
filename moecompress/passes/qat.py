"""The routing-replay QAT pass: post-training quantisation with load-aware error adapters, then fine-tuning of
those adapters by distillation from the full-precision model with its routes replayed (see
:mod:`moecompress.training.loop`).

1. The quantise pass writes a native checkpoint (RTN or GPTQ experts plus adapters, ``--lowrank-budget`` spent
   by load, or one ``--adapter-rank`` everywhere) into a hidden sibling of the output: the PTQ starting point,
   and the baseline this pass must beat at the same adapter bytes.
2. That checkpoint is loaded through the plugin as the student, the input as the teacher; both are held whole
   (this is one of the passes allowed to), on the run's compute device (bf16 on CUDA, float32 on the CPU).
3. The adapters train; the held-out evaluation runs before (= PTQ) and after, against the teacher.
4. The output is the PTQ checkpoint as stored with the trained adapters in place of the initial ones, written
   atomically by the pipeline's writer (:func:`~moecompress.runner.pipeline.write_model`).
"""

from __future__ import annotations

import shutil
from contextlib import suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..calibration.batches import consecutive_windows, sampled_windows, tokenize_documents
from ..calibration.sources import load_documents
from ..checkpoint import CheckpointReader
from ..checkpoint.stream import check_output_is_not_input
from ..checkpoint.writer import hidden_dir, output_exists
from ..defaults import (
    CALIBRATION_LEAST,
    DEFAULT_CALIB_TOKENS,
    DEFAULT_DATA,
    DEFAULT_EVAL_DATA,
    DEFAULT_EVAL_TOKENS,
    DEFAULT_SEQ_LEN,
)
from ..device import compute_device, device_map_for
from ..errors import OptionError, UserInputError
from ..evals.footprint import checkpoint_footprint
from ..evals.perplexity import evaluate_windows
from ..loading import load_adapter, load_model, load_tokenizer
from ..output_report import update_report
from ..quantization.formats import format_of
from ..quantization.formats.native import ADAPTER_DTYPE
from ..training.loop import TrainingConfig, prepare_student, round_adapters_to, train_adapters
from ..training.replay import REPLAY_WEIGHTS, ReplaySchedule
from ..vocabulary import named
from .base import InputFacts, LayerPass
from .options import When, check_declared, option
from .quantize import QuantizeConfig, quantize_checkpoint

DEFAULT_LOWRANK_BUDGET = 0.375


@dataclass(frozen=True)
class QATConfig:
    quantize: QuantizeConfig = field(
        default_factory=lambda: QuantizeConfig(scheme="int2", lowrank_budget=DEFAULT_LOWRANK_BUDGET),
        metadata=option(
            "The post-training quantisation training starts from: a quantize pass's keys (native format, with "
            "adapters).",
            nested=("scheme", "method", "group_size", "symmetric", "lowrank_budget", "lowrank_rank", "rank_alloc"),
            nested_changes={
                "scheme": {"required": True, "help": "Expert quantisation scheme (as in `moecompress quantize`)."},
                "lowrank_budget": {
                    "help": "Adapter budget in bits per routed expert weight, spent by load as in quantize "
                    f"[default: {DEFAULT_LOWRANK_BUDGET}, unless --adapter-rank is given].",
                    "cli_default": None,
                    "min_open": True,
                },
            },
        ),
    )
    replay: str = field(
        default="none",
        metadata=option(
            "When the full-precision model's recorded routes replace the student's own during training: all, none, "
            "first:F (the first fraction F of the steps, then free routing) or layers:L1,L2 (those MoE layers). "
            "In held-out perplexity replay did not beat none on builtin:tiny-moe or on 64-expert and 12-layer models "
            "(docs/qat.md), hence the default; it lowered the KL to the full-precision model slightly."
        ),
    )
    replay_weights: str = field(
        default="router",
        metadata=option(
            "router: the replayed experts' weights come from the student's frozen router on its own hidden states; "
            "recorded: the full-precision model's weights as recorded.",
            choices=REPLAY_WEIGHTS,
            applies=When(f"{named('replay')} other than none", lambda c: c.replay != "none"),
        ),
    )
    steps: int = field(default=200, metadata=option("Optimiser steps.", min=1))
    lr: float = field(default=1e-3, metadata=option("Learning rate of the adapters (AdamW).", min=0, min_open=True))
    batch_size: int = field(default=8, metadata=option("Windows per step.", min=1))
    seq_len: int = field(
        default=DEFAULT_SEQ_LEN,
        metadata=option("Tokens per training window.", min=CALIBRATION_LEAST["seq_len"], shared=True),
    )
    train_tokens: int = field(
        default=65536,
        metadata=option("Tokens of --calib (random whole windows) that training cycles through.", min=2),
    )
    lm_loss_weight: float = field(
        default=0.0, metadata=option("Add this times the language-modelling loss to the distillation KL.", min=0)
    )
    seed: int = field(default=0, metadata=option("Seed for windows and batch order."))

    def validate(self) -> None:
        def refuse(template: str, owner: type = QATConfig) -> OptionError:
            return OptionError(template, owner)

        check_declared(self)
        self.quantize.validate()
        if not format_of(self.quantize.format).holds_adapters:
            raise refuse(
                f"{named('format', self.quantize.format)}: QAT writes the native format (its adapters live there)",
                QuantizeConfig,
            )
        if not (self.quantize.lowrank_budget or self.quantize.lowrank_rank):
            raise refuse(
                f"QAT trains low-rank adapters: give {named('lowrank_budget')} above 0 or {named('lowrank_rank')} "
                "above 0",
                QuantizeConfig,
            )
        try:
            ReplaySchedule.parse(self.replay)
        except UserInputError:
            raise refuse(
                f"{named('replay', self.replay)}: use all, none, first:F (0 <= F <= 1) or layers:L1,L2,..."
            ) from None

    def check_input(self, facts: InputFacts) -> None:
        """Refuse a quantised input (QAT starts from full precision), what the quantize settings refuse, and an
        input whose routes cannot be replayed, before any work."""
        from ..runner.preflight import check_seq_len

        if facts.quantized:
            raise UserInputError(
                f"{facts.model_dir}: the checkpoint is already quantised ({facts.quantized}); "
                "start from a bf16/fp16 one"
            )
        self.quantize.check_input(facts)
        facts.adapter.check_route_replay(str(facts.model_dir))
        check_seq_len(facts.adapter, self.seq_len, named("seq_len"), QATConfig)

    def training(self) -> TrainingConfig:
        return TrainingConfig(
            steps=self.steps,
            lr=self.lr,
            batch_size=self.batch_size,
            lm_loss_weight=self.lm_loss_weight,
            replay=ReplaySchedule.parse(self.replay),
            replay_weights=self.replay_weights,
            seed=self.seed,
        )


def _adapter_key(name: str) -> bool:
    return ".lowrank." in name and name.endswith(("_L", "_R"))


class _TrainedAdapters(LayerPass):
    """Writes QAT's output (:func:`~moecompress.runner.pipeline.write_model`): the PTQ checkpoint ``source`` as stored,
    every adapter replaced by the student's (as stored: bf16). A stored adapter's module is found in the student
    under the name transformers' conversion gives it at load (``model.layers`` is ``model.language_model.layers``
    where a release keeps its text model under its own names)."""

    name = "qat"

    def __init__(self, source: Path, student: torch.nn.Module, report: dict[str, Any]):
        from ..quantization.hf_quantizer import loaded_module_names

        super().__init__(None)
        self.trained = {name: p.detach() for name, p in student.named_parameters() if _adapter_key(name)}
        with CheckpointReader(source) as reader:
            modules = sorted({key.partition(".lowrank.")[0] for key in reader.keys() if _adapter_key(key)})
        self.loaded = loaded_module_names(student, modules)
        self.written = report

    def _replaced(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for key, tensor in tensors.items():
            if _adapter_key(key):
                module, _, rest = key.partition(".lowrank.")
                name = f"{self.loaded[module]}.lowrank.{rest}"
                if name not in self.trained:
                    raise RuntimeError(f"{key}: the student has no such adapter")
                tensor = self.trained.pop(name).to(ADAPTER_DTYPE).cpu()
            out[key] = tensor
        return out

    def stored_rewrite(self):
        return lambda layer, tensors: self._replaced(tensors)

    def write_outside(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._replaced(tensors)

    def finish_config(self, config: dict[str, Any]) -> dict[str, Any]:
        if self.trained:
            raise RuntimeError(f"trained adapters missing from the checkpoint: {sorted(self.trained)[:3]}")
        return config

    def report(self) -> dict[str, Any]:
        return self.written


def qat_checkpoint(
    model_dir: Path,
    out_dir: Path,
    config: QATConfig,
    *,
    data: str = DEFAULT_DATA,
    calib_tokens: int = DEFAULT_CALIB_TOKENS,
    eval_data: str | None = DEFAULT_EVAL_DATA,
    eval_tokens: int | None = DEFAULT_EVAL_TOKENS,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Quantise ``model_dir``, fine-tune the adapters with routing replay, write ``out_dir``; returns the report.

    ``data`` feeds both the PTQ calibration (``calib_tokens``) and the training windows (its calibration part
    for built-in sources); ``eval_data``'s held-out part measures before and after.
    """
    from ..runner.pipeline import write_model

    config.validate()
    out_dir = Path(out_dir)
    check_output_is_not_input(model_dir, out_dir)
    if out_dir.exists() and not overwrite:
        raise output_exists(out_dir.absolute())
    adapter = load_adapter(model_dir)
    schedule = ReplaySchedule.parse(config.replay)
    try:
        schedule.check_layers(adapter.moe_layers())
    except OptionError as error:
        error.owner = error.owner or QATConfig
        raise
    tokenizer = load_tokenizer(model_dir)
    train_stream = tokenize_documents(load_documents(data, default_part="calib"), tokenizer)
    train_windows = sampled_windows(train_stream, config.seq_len, config.train_tokens, config.seed)
    eval_windows = None
    if eval_data:
        eval_stream = tokenize_documents(load_documents(eval_data, default_part="heldout"), tokenizer)
        eval_windows = consecutive_windows(eval_stream, config.seq_len, eval_tokens)

    run_dir = hidden_dir(out_dir.absolute(), "run")
    ptq_dir = run_dir / "qat-ptq"
    try:
        ptq_report = quantize_checkpoint(
            model_dir,
            ptq_dir,
            replace(config.quantize, seed=config.seed),
            calib=data,
            calib_tokens=calib_tokens,
            seq_len=config.seq_len,
            eval_data=None,
            overwrite=True,
            progress=progress,
        )
        device = compute_device()
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        device_map = device_map_for(device)
        student_adapter = load_adapter(ptq_dir)
        teacher = load_model(model_dir, adapter, dtype, device_map)
        student = load_model(ptq_dir, student_adapter, dtype, device_map)
        for parameter in teacher.parameters():
            parameter.requires_grad_(False)
        trainable = prepare_student(student, dtype)
        reference = (teacher, adapter)
        before = evaluate_windows(student, student_adapter, eval_windows, reference, progress) if eval_windows else None
        log = train_adapters(
            student, student_adapter, teacher, adapter, train_windows.input_ids, config.training(), trainable, progress
        )
        round_adapters_to(student, ADAPTER_DTYPE)
        after = evaluate_windows(student, student_adapter, eval_windows, reference, progress) if eval_windows else None
        report = dict(ptq_report)
        report.pop("eval", None)
        report.update(
            {
                "pass": "qat",
                "source": str(model_dir),
                "quantize_config": ptq_report["config"],
                "config": {**asdict(config), "quantize": None},
                "qat": {
                    "replay": schedule.describe(),
                    "replay_weights": config.replay_weights,
                    "data": data,
                    "train_tokens": int(train_windows.num_tokens),
                    "device": str(device),
                    "dtype": str(dtype).removeprefix("torch."),
                    **log.to_json(),
                },
            }
        )
        if before is not None and after is not None:
            report["eval"] = {"data": eval_data, "before": before.to_json(), "after": after.to_json()}
        write_model(
            ptq_dir, out_dir, _TrainedAdapters(ptq_dir, student, report), overwrite=overwrite, progress=progress
        )
    finally:
        shutil.rmtree(ptq_dir, ignore_errors=True)
        with suppress(OSError):
            run_dir.rmdir()
    report["footprint"] = checkpoint_footprint(out_dir).to_json()
    update_report(out_dir, report)
    return report
