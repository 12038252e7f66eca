"""The two training loops of head pruning: gates on a frozen model, then distillation of the pruned model.

Gates minimise the language-modelling loss (as in Sheared-LLaMA; ``objective="kl"`` uses the KL to the original
instead); distillation minimises the KL divergence from the original model's next-token distributions (the
teacher) to the student's, on the calibration windows. The teacher's log-probabilities are computed once and kept
in bf16 (where the teacher computed them: on its device) when they fit in ``TEACHER_CACHE_BYTES``; otherwise they
are recomputed every step.

Both loops compute on the model's device: the calibration batches stay on the host and move per step. The gates and
the Lagrangian stay on the host (a few scalars per layer; ``index_add`` on CUDA is not deterministic), and each
step's sampled gates move to the device; gradients flow back through the move.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..device import HOST
from ..progress import bar as progress_bar
from .gates import HeadGates, SparsityLagrangian
from .masks import GateMasks

TEACHER_CACHE_BYTES = 2**30


def model_device(model: torch.nn.Module) -> torch.device:
    """Where ``model``'s parameters are (the host for a model without any)."""
    parameter = next(model.parameters(), None)
    return HOST if parameter is None else parameter.device


class Teacher:
    """The original model's next-token log-probabilities for each calibration batch."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], batches: list[torch.Tensor], vocab: int):
        self.forward, self.batches = forward, batches
        tokens = sum(batch.numel() for batch in batches)
        self.cache = None
        if tokens * vocab * 2 <= TEACHER_CACHE_BYTES:
            self.cache = [self._compute(batch).to(torch.bfloat16) for batch in batches]

    def _compute(self, batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return F.log_softmax(self.forward(batch)[:, :-1].float(), dim=-1)

    def kl(self, index: int, student_logits: torch.Tensor) -> torch.Tensor:
        """Mean over predicted tokens of KL(teacher ‖ student)."""
        teacher = self.cache[index].float() if self.cache is not None else self._compute(self.batches[index])
        student = F.log_softmax(student_logits[:, :-1].float(), dim=-1)
        return (teacher.exp() * (teacher - student)).sum(-1).mean()


def next_token_loss(input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (the language-modelling loss)."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))


@dataclass(frozen=True)
class GateSchedule:
    steps: int
    lr: float
    lambda_lr: float
    noise_bias: float
    warmup_fraction: float
    objective: str = "lm"

    def progress(self, step: int) -> float:
        """0 → 1 over the warm-up: the target ramps down from every unit open, the noise bias decays to 0."""
        warmup = max(1, round(self.warmup_fraction * self.steps))
        return min(1.0, step / warmup)


@dataclass
class GateRun:
    """What gate training leaves: final logits, the open-probability trajectory and the loss curve."""

    scores: list[torch.Tensor]
    trajectory_steps: list[int] = field(default_factory=list)
    trajectory: list[list[list[float]]] = field(default_factory=list)
    curve: list[dict[str, float]] = field(default_factory=list)


def train_gates(
    model: torch.nn.Module,
    masks: GateMasks,
    gates: HeadGates,
    constraint_of_unit: torch.Tensor,
    targets: torch.Tensor,
    batches: list[torch.Tensor],
    teacher: Teacher,
    schedule: GateSchedule,
    seed: int,
    progress: bool = True,
) -> GateRun:
    """Train the gates with the model frozen. ``constraint_of_unit`` maps every unit (all layers concatenated)
    to its constraint; ``targets`` holds each constraint's target count of open units."""
    device = model_device(model)
    constraints = targets.numel()
    units = torch.bincount(constraint_of_unit, minlength=constraints).float()
    lagrangian = SparsityLagrangian(constraints)
    # plain SGD: Adam would normalise the penalty's gradient to its sign and make the gates oscillate
    gate_opt = torch.optim.SGD(gates.parameters(), lr=schedule.lr)
    lambda_opt = torch.optim.SGD(lagrangian.parameters(), lr=schedule.lambda_lr, maximize=True)
    generator = torch.Generator().manual_seed(seed)
    record_every = max(1, schedule.steps // 20)
    run = GateRun(scores=[])
    for step in progress_bar(range(schedule.steps), desc="gates", unit="step", disable=not progress):
        if step % record_every == 0:
            _record(run, step, gates)
        index = step % len(batches)
        batch = batches[index].to(device)
        ramp = schedule.progress(step)
        masks.set([g.to(device) for g in gates.sample(batch.shape[0], schedule.noise_bias * (1 - ramp), generator)])
        logits = model(input_ids=batch, use_cache=False).logits
        task = next_token_loss(batch, logits) if schedule.objective == "lm" else teacher.kl(index, logits)
        masks.set(None)
        expected = torch.zeros(constraints, device=units.device).index_add(
            0, constraint_of_unit, torch.cat(gates.open_probability())
        )
        target = units - (units - targets) * ramp
        penalty = lagrangian(expected, target, units)
        gate_opt.zero_grad()
        lambda_opt.zero_grad()
        (task.to(penalty.device) + penalty).backward()
        gate_opt.step()
        lambda_opt.step()
        if step % record_every == 0 or step == schedule.steps - 1:
            run.curve.append(
                {
                    "step": step,
                    schedule.objective: round(float(task.detach()), 5),
                    "expected_open": round(float(expected.detach().sum()), 4),
                    "target_open": round(float(target.sum()), 4),
                    "noise_bias": round(schedule.noise_bias * (1 - ramp), 4),
                }
            )
    _record(run, schedule.steps, gates)
    run.scores = gates.scores()
    return run


def _record(run: GateRun, step: int, gates: HeadGates) -> None:
    run.trajectory_steps.append(step)
    run.trajectory.append([[round(float(p), 4) for p in probs.detach()] for probs in gates.open_probability()])


def distill(
    student: torch.nn.Module,
    parameters: list[torch.nn.Parameter],
    batches: list[torch.Tensor],
    teacher: Teacher,
    steps: int,
    lr: float,
    progress: bool = True,
) -> list[dict[str, float]]:
    """Fine-tune ``parameters`` of the pruned model towards the teacher; returns the KL curve."""
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    device = model_device(student)
    record_every = max(1, steps // 20)
    curve = []
    for step in progress_bar(range(steps), desc="distill", unit="step", disable=not progress):
        index = step % len(batches)
        kl = teacher.kl(index, student(input_ids=batches[index].to(device), use_cache=False).logits)
        optimizer.zero_grad()
        kl.backward()
        optimizer.step()
        if step % record_every == 0 or step == steps - 1:
            curve.append({"step": step, "kl": round(float(kl.detach()), 5)})
    return curve
