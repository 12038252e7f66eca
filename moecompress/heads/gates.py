"""Learnable binary gates and the Lagrangian that drives their expected number of open gates to a target.

Each unit has a logit ``log_alpha``. A training sample draws logistic noise ``n = log u - log(1 - u)``
(``u ~ U(0, 1)``), shifted toward closing by the noise bias ``b >= 0``, and opens the gate when
``n - b + log_alpha > 0``: the forward pass sees exactly 0 or 1, open with probability
``sigmoid(log_alpha - b)``. Gradients pass straight through the relaxed gate ``sigmoid((n - b + log_alpha) / T)``
(binary concrete with a straight-through estimator; hard-concrete's clamp would give no gradient at all on the
many samples that saturate). The sparsity objective uses the unbiased open probability ``sigmoid(log_alpha)``:
the bias is exploration, not part of the model.
"""

from __future__ import annotations

import torch
from torch import nn


class HeadGates(nn.Module):
    """One logit per unit per layer (layers may hold different numbers of units), on the host: a few scalars per
    layer, sampled from a host generator; only the samples move to the model's device."""

    def __init__(self, units_per_layer: list[int], init_log_alpha: float = 2.0, temperature: float = 2 / 3):
        super().__init__()
        self.log_alpha = nn.ParameterList(
            nn.Parameter(torch.full((n,), float(init_log_alpha), device="cpu")) for n in units_per_layer
        )
        self.temperature = temperature

    def sample(self, batch: int, noise_bias: float, generator: torch.Generator) -> list[torch.Tensor]:
        """Per layer, ``[batch, units]`` gates: binary values, straight-through gradients."""
        out = []
        for log_alpha in self.log_alpha:
            u = torch.rand(batch, log_alpha.numel(), generator=generator, device=generator.device)
            u = u.clamp(1e-6, 1 - 1e-6)
            logits = torch.log(u) - torch.log1p(-u) - noise_bias + log_alpha
            soft = torch.sigmoid(logits / self.temperature)
            hard = (logits > 0).to(soft.dtype)
            out.append(hard + soft - soft.detach())
        return out

    def open_probability(self) -> list[torch.Tensor]:
        return [torch.sigmoid(log_alpha) for log_alpha in self.log_alpha]

    def scores(self) -> list[torch.Tensor]:
        return [log_alpha.detach().clone() for log_alpha in self.log_alpha]


class SparsityLagrangian(nn.Module):
    """``sum_c lambda1_c * gap_c + lambda2_c * gap_c^2`` with ``gap_c`` the expected open count of constraint
    ``c`` minus its target, as a fraction of the constraint's units (Sheared-LLaMA's form). The gates minimise it;
    the multipliers are trained by gradient ascent, so a gap that persists costs more and more."""

    def __init__(self, constraints: int):
        super().__init__()
        self.lambda1 = nn.Parameter(torch.zeros(constraints, device="cpu"))
        self.lambda2 = nn.Parameter(torch.zeros(constraints, device="cpu"))

    def forward(self, expected: torch.Tensor, target: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
        gap = (expected - target) / units
        return (self.lambda1 * gap + self.lambda2 * gap**2).sum()
