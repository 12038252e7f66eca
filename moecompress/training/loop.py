"""Quantisation-aware fine-tuning of expert-side adapters by distillation, with the teacher's routes replayed.

The student is a quantised model loaded through the plugin: its expert weights are fixed quantised values
(dequantised once and cached), and only the low-rank error adapters ``L·R`` train. The quantiser therefore has
no rounding to differentiate through: the forward always sees ``Q(W)``, the gradient reaches the adapters
exactly, and the straight-through estimator a trainable ``W`` would need has nothing to do here. Router,
attention, norms and embeddings are frozen.

Every step the teacher (the full-precision model) runs the batch under ``no_grad``; its routes are recorded by
:class:`~.replay.RouteCapture` and, on the layers the schedule names, replayed into the student's forward by
:class:`~.replay.RouteReplay`. The loss is KL(teacher ‖ student) over every position's next-token
distribution, plus ``lm_loss_weight`` times the language-modelling loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..evals.routing import routing_agreement
from ..families import FamilyAdapter
from ..progress import bar as progress_bar
from ..quantization.modules import QuantizedExperts
from .replay import ReplaySchedule, RouteCapture, RouteReplay


@dataclass(frozen=True)
class TrainingConfig:
    steps: int = 200
    lr: float = 1e-3
    batch_size: int = 8
    warmup_fraction: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    lm_loss_weight: float = 0.0
    replay: ReplaySchedule = field(default_factory=ReplaySchedule)
    replay_weights: str = "router"
    seed: int = 0


@dataclass
class TrainingLog:
    """Per step: the loss, the KL part, the share of MoE layers replayed, and how often the student's own router
    (computed even where replaced) agreed with the teacher's top-k."""

    loss: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    replayed_layers: list[int] = field(default_factory=list)
    own_route_agreement: list[float] = field(default_factory=list)
    optimizer: str = ""
    trainable_parameters: int = 0

    def to_json(self) -> dict:
        return {
            "optimizer": self.optimizer,
            "trainable_parameters": self.trainable_parameters,
            "loss": [round(v, 6) for v in self.loss],
            "kl": [round(v, 6) for v in self.kl],
            "replayed_layers": self.replayed_layers,
            "own_route_agreement": [round(v, 6) for v in self.own_route_agreement],
        }


def expert_modules(model: torch.nn.Module) -> list[QuantizedExperts]:
    return [module for module in model.modules() if isinstance(module, QuantizedExperts)]


def prepare_student(model: torch.nn.Module, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Freeze everything, cache the dequantised experts, and return the adapters' parameters made trainable."""
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    trainable: list[torch.nn.Parameter] = []
    for experts in expert_modules(model):
        experts.cache_dequantized(dtype)
        for parameter in experts.lowrank.parameters():
            parameter.requires_grad_(True)
            trainable.append(parameter)
    return trainable


def round_adapters_to(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round the trained adapters to the stored dtype in place, so the in-memory model is the one written."""
    with torch.no_grad():
        for experts in expert_modules(model):
            for parameter in experts.lowrank.parameters():
                parameter.copy_(parameter.to(dtype).to(parameter.dtype))
                parameter.requires_grad_(False)
            experts.drop_dequantized()


def make_optimizer(parameters: list[torch.nn.Parameter], config: TrainingConfig) -> tuple[torch.optim.Optimizer, str]:
    """bitsandbytes' 8-bit AdamW where the parameters live on a GPU and it is installed; torch AdamW otherwise."""
    if parameters and parameters[0].is_cuda:
        try:
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(parameters, lr=config.lr, weight_decay=config.weight_decay), "bnb.AdamW8bit"
        except ImportError:
            pass
    return torch.optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay), "torch.AdamW"


def lr_factor(step: int, steps: int, warmup_fraction: float) -> float:
    """Linear warm-up, then cosine decay to zero."""
    warmup = max(1, round(warmup_fraction * steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def distillation_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher ‖ student) of the next-token distributions."""
    vocab = student_logits.shape[-1]
    student = F.log_softmax(student_logits.float().reshape(-1, vocab), dim=-1)
    teacher = F.log_softmax(teacher_logits.float().reshape(-1, vocab), dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean")


def train_adapters(
    student: torch.nn.Module,
    student_adapter: FamilyAdapter,
    teacher: torch.nn.Module,
    teacher_adapter: FamilyAdapter,
    windows: torch.Tensor,
    config: TrainingConfig,
    trainable: list[torch.nn.Parameter],
    progress: bool = True,
) -> TrainingLog:
    """Train ``trainable`` (the student's adapters) for ``config.steps`` batches of ``windows`` ``[N, L]``.

    Batches are drawn without replacement from a seeded permutation of the windows, renewed each epoch.
    """
    log = TrainingLog(trainable_parameters=sum(p.numel() for p in trainable))
    optimizer, log.optimizer = make_optimizer(trainable, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config.steps, config.warmup_fraction)
    )
    moe_layers = student_adapter.moe_layers()
    capture = RouteCapture(teacher, teacher_adapter)
    replay = RouteReplay(student, student_adapter, config.replay_weights)
    generator = torch.Generator().manual_seed(config.seed)
    order: list[int] = []
    student_device = student.get_input_embeddings().weight.device
    teacher_device = teacher.get_input_embeddings().weight.device
    student.train()
    try:
        for step in progress_bar(range(config.steps), desc="qat", unit="step", disable=not progress):
            if len(order) < config.batch_size:
                order += torch.randperm(windows.shape[0], generator=generator, device=generator.device).tolist()
            batch, order = order[: config.batch_size], order[config.batch_size :]
            input_ids = windows[batch].to(student_device)
            with torch.no_grad():
                teacher_logits = teacher(input_ids=input_ids.to(teacher_device), use_cache=False).logits
            replay.routes = capture.routes
            replay.active = config.replay.layers_at(step, config.steps, moe_layers)
            student_logits = student(input_ids=input_ids, use_cache=False).logits
            kl = distillation_kl(student_logits, teacher_logits.to(student_logits.device))
            loss = kl
            if config.lm_loss_weight:
                lm = F.cross_entropy(
                    student_logits[:, :-1].float().reshape(-1, student_logits.shape[-1]), input_ids[:, 1:].reshape(-1)
                )
                loss = loss + config.lm_loss_weight * lm
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if config.grad_clip:
                torch.nn.utils.clip_grad_norm_(trainable, config.grad_clip)
            optimizer.step()
            scheduler.step()
            log.loss.append(loss.item())
            log.kl.append(kl.item())
            log.replayed_layers.append(len(replay.active))
            total, count = routing_agreement(
                {layer: ids.cpu() for layer, (ids, _) in replay.routes.items()},
                {layer: ids.cpu() for layer, ids in replay.own_ids.items()},
            )
            log.own_route_agreement.append(total / count)
    finally:
        student.eval()
        capture.remove()
        replay.remove()
    return log
