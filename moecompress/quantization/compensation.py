"""Per-layer input of the low-rank compensation: each routed expert's gate, up and down quantisation error,
whitened by the inputs the router sends that expert, and the expert's load (see :mod:`.lowrank`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..families import FamilyAdapter, MoEWeights
from .experts import QuantizedMoE
from .lowrank import ErrorSpectrum, error_spectrum, whitening_factor

MATRICES: tuple[str, ...] = ("gate", "up", "down")


@dataclass
class LayerErrors:
    """Keys are ``(expert position, matrix)``; ``inputs`` the routed calibration inputs of each matrix."""

    spectra: dict[tuple[int, str], ErrorSpectrum]
    loads: dict[tuple[int, str], float]
    errors: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    inputs: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    plain_svd: list[int] = field(default_factory=list)


def expert_matrices(moe: MoEWeights, expert: int) -> dict[str, torch.Tensor]:
    """An expert's gate ``[I, H]``, up ``[I, H]`` and down ``[H, I]`` weights from the canonical view."""
    inter = moe.intermediate_size
    return {"gate": moe.gate_up[expert, :inter], "up": moe.gate_up[expert, inter:], "down": moe.down[expert]}


def layer_errors(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    quantized: QuantizedMoE,
    hidden: torch.Tensor,
    *,
    keep: int,
    min_tokens: int,
    weighting: str = "tokens",
    keep_inputs: bool = False,
) -> LayerErrors:
    """Spectra (with ``keep`` components' factors) and loads of every expert matrix of one block.

    The down projection's inputs are the *original* block's activations on the routed tokens, i.e. what the
    compensated expert should reproduce.
    """
    hidden = hidden.float()
    ids, weights = adapter.routing_rule().route(adapter.router_logits(moe, hidden), moe.correction_bias)
    dequantized = quantized.dequantized()
    total_slots = float(ids.numel())
    total_weight = float(weights.sum()) or 1.0
    result = LayerErrors({}, {})
    inter = moe.intermediate_size
    for expert in range(moe.num_experts):
        routed = ids == expert
        tokens = torch.where(routed.any(dim=-1))[0]
        load = (
            float(routed.sum()) / total_slots if weighting == "tokens" else float(weights[routed].sum()) / total_weight
        )
        x = hidden[tokens]
        original = expert_matrices(moe, expert)
        approximate = expert_matrices(dequantized, expert)
        projected = F.linear(x, moe.gate_up[expert].float())
        if moe.gate_up_bias is not None:
            projected = projected + moe.gate_up_bias[expert].float()
        down_input = adapter.activation(projected[:, :inter], projected[:, inter:])
        enough = tokens.numel() >= min_tokens
        if not enough:
            result.plain_svd.append(moe.expert_ids[expert])
        factors = {
            "gate": whitening_factor(x) if enough else None,
            "down": whitening_factor(down_input) if enough else None,
        }
        factors["up"] = factors["gate"]
        for which in MATRICES:
            key = (expert, which)
            error = original[which].float() - approximate[which].float()
            result.spectra[key] = error_spectrum(error, factors[which], keep)
            result.loads[key] = load
            if keep_inputs:
                result.errors[key] = error
                result.inputs[key] = down_input if which == "down" else x
    return result


def measured_error(errors: LayerErrors, ranks: dict[tuple[int, str], int]) -> float:
    """Σ load · mean over routed tokens of ‖(E − L·R)·x‖², computed directly (not from the spectrum)."""
    total = 0.0
    for key, spectrum in errors.spectra.items():
        x = errors.inputs[key]
        if x.shape[0] == 0:
            continue
        residual = errors.errors[key]
        rank = ranks.get(key, 0)
        if rank:
            left, right = spectrum.adapter(rank)
            residual = residual - left @ right
        total += errors.loads[key] * float(((x @ residual.T) ** 2).sum()) / x.shape[0]
    return total
