"""Per-layer input of the low-rank compensation: each routed expert's gate, up and down quantisation error,
whitened by the inputs the router sends that expert, and its weight in the global objective: the expert's load
times how strongly that matrix's error reaches the expert's output (see :mod:`.lowrank`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..device import moe_on
from ..families import FamilyAdapter, MoEWeights
from ..families.base import split_gate_up
from .experts import QuantizedMoE, route_tokens
from .lowrank import ErrorSpectrum, error_spectrum

MATRICES: tuple[str, ...] = ("gate", "up", "down")


@dataclass
class LayerErrors:
    """Keys are ``(expert position, matrix)``; ``inputs`` the routed calibration inputs of each matrix."""

    spectra: dict[tuple[int, str], ErrorSpectrum]
    loads: dict[tuple[int, str], float]
    errors: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    inputs: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    plain_svd: list[int] = field(default_factory=list)
    measured: tuple[float, float] | None = None
    """With ``measure``: the block's weighted error without adapters and with the kept components (what
    :func:`measured_error` gives for no ranks and for ``keep``), summed expert by expert."""


def expert_matrices(moe: MoEWeights, expert: int) -> dict[str, torch.Tensor]:
    """An expert's gate ``[I, H]`` (gated experts only), up ``[I, H]`` and down ``[H, I]`` weights from the
    canonical view."""
    return split_expert(moe.gate_up[expert], moe.down[expert], moe.intermediate_size)


def split_expert(gate_up: torch.Tensor, down: torch.Tensor, inter: int) -> dict[str, torch.Tensor]:
    """One expert's fused ``gate_up [2I, H]`` (``[I, H]`` up rows alone for a non-gated expert) and ``down [H, I]``
    as its gate, up and down matrices (no gate for a non-gated expert)."""
    if gate_up.shape[0] == inter:
        return {"up": gate_up, "down": down}
    return {"gate": gate_up[:inter], "up": gate_up[inter:], "down": down}


def layer_errors(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    quantized: QuantizedMoE,
    hidden: torch.Tensor,
    *,
    keep: int | Mapping[tuple[int, str], int],
    min_tokens: int,
    weighting: str = "tokens",
    keep_inputs: bool = False,
    measure: bool = False,
    token_weights: torch.Tensor | None = None,
    only_kept: bool = False,
    experts: list[int] | None = None,
    router_input: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    sequence_lengths: list[int] | None = None,
) -> LayerErrors:
    """Spectra (with ``keep`` components' factors, one number for all or one per ``(expert, matrix)``, absent
    meaning 0) and loads of every expert matrix of one block.

    ``weighting="tokens"``: an expert's load is its share of routed tokens and every routed token counts alike;
    ``"gate"``: each token also counts with its squared routing weight (the block adds the expert's output
    scaled by that weight, so this is the block-output error). Where the family's rule scales the expert's input
    instead (Llama 4), ``x`` is the scaled token and the output weight is 1.

    The down projection's inputs are the *original* block's activations on the routed tokens, i.e. what the
    compensated expert should reproduce.

    ``token_weights`` (one per row of ``hidden``) multiply each token's squared error, e.g. the downstream
    sensitivity of the block's output at that token. A family that routes whole sequences routes by ``hidden``'s
    ``sequence_lengths`` (a token past its expert's capacity is no expert's).

    Memory is one block's weights plus one expert's work at a time; ``keep_inputs`` (for analysis) instead
    keeps every matrix's error and inputs, and ``measure`` sums the measured errors as it goes. ``only_kept``
    (the rewriting sweep, which uses nothing else) computes spectra only for matrices given components;
    ``experts`` (positions) restricts everything to those experts, routed as by the whole block.
    """
    hidden = hidden.float()
    moe = moe_on(moe, hidden.device)
    if token_weights is not None:
        token_weights = token_weights.to(hidden.device)
    rule = adapter.routing_rule()
    router_input = hidden if router_input is None else router_input.to(hidden.device).float()
    ids, weights = route_tokens(adapter, moe, hidden, router_input, token_ids, sequence_lengths)
    total_slots = float(ids.numel())
    result = LayerErrors({}, {})
    without_adapters = with_adapters = 0.0
    inter = moe.intermediate_size
    for expert in range(moe.num_experts) if experts is None else experts:
        routed = ids == expert
        tokens = torch.where(routed.any(dim=-1))[0]
        load = float(routed.sum()) / total_slots
        gate_weight = (weights * routed).sum(dim=-1)[tokens].float().unsqueeze(-1)
        x = rule.expert_input(hidden[tokens], gate_weight)
        gate_weight = rule.output_weight(gate_weight)
        original = expert_matrices(moe, expert)
        approximate = split_expert(*(t.to(hidden.device) for t in quantized.dequantized_expert(expert)), inter)
        projected = F.linear(x, moe.gate_up[expert].float())
        if moe.gate_up_bias is not None:
            projected = projected + moe.gate_up_bias[expert].float()
        down_input = adapter.expert_hidden(projected, inter, moe.layer)
        enough = tokens.numel() >= min_tokens
        if not enough:
            result.plain_svd.append(moe.expert_ids[expert])
        token_scale = gate_weight if weighting == "gate" else torch.ones_like(gate_weight)
        if token_weights is not None:
            token_scale = token_scale * token_weights[tokens].float().sqrt().unsqueeze(-1)
        scaled = x * token_scale
        routed_inputs = {"gate": scaled, "up": scaled, "down": down_input * token_scale}
        errors = {which: original[which].float() - approximate[which].float() for which in original}
        reach = output_reach(adapter, moe, expert, x, projected, errors)
        for which in original:
            key = (expert, which)
            error = errors[which]
            kept = keep if isinstance(keep, int) else keep.get(key, 0)
            if kept or not only_kept:
                result.spectra[key] = error_spectrum(error, routed_inputs[which] if enough else None, kept)
            result.loads[key] = load * reach[which]
            if not (keep_inputs or measure):
                continue
            inputs = routed_inputs[which]
            if keep_inputs:
                result.errors[key] = error
                result.inputs[key] = inputs
            if measure:
                residual = _residual(error, result.spectra.get(key), kept)
                without_adapters += result.loads[key] * _output_error(inputs, error)
                with_adapters += result.loads[key] * _output_error(inputs, residual)
    if measure:
        result.measured = (without_adapters, with_adapters)
    return result


def _residual(error: torch.Tensor, spectrum: ErrorSpectrum | None, rank: int) -> torch.Tensor:
    if not rank:
        return error
    left, right = spectrum.adapter(rank)
    return error - left @ right


def _output_error(inputs: torch.Tensor, residual: torch.Tensor) -> float:
    """Mean over the routed tokens of ``‖residual · x‖²`` (0 for an expert no token reached)."""
    if inputs.shape[0] == 0:
        return 0.0
    return float(((inputs @ residual.T) ** 2).sum()) / inputs.shape[0]


def output_reach(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    expert: int,
    x: torch.Tensor,
    projected: torch.Tensor,
    errors: dict[str, torch.Tensor],
) -> dict[str, float]:
    """How much of a gate or up error reaches the expert's output: ``Σ‖W_down·Δact‖² / Σ‖Δ‖²`` over the routed
    tokens for the actual quantisation error ``Δ``, so gate, up and down gains are ranked in one unit (the
    expert's output). 1 for down, whose error is already in that unit."""
    reach = {"down": 1.0}
    inputs = [which for which in errors if which != "down"]
    if x.shape[0] == 0:
        return {which: 1.0 for which in errors}
    gate, up = split_gate_up(projected, moe.intermediate_size)
    down = moe.down[expert].float()
    activation = adapter.activation_of(moe.layer)
    base = activation(gate, up)
    for which in inputs:
        delta = x @ errors[which].T
        moved = activation(gate + delta, up) if which == "gate" else activation(gate, up + delta)
        energy = float((delta**2).sum())
        reach[which] = float(((moved - base) @ down.T).pow(2).sum()) / energy if energy > 0 else 1.0
    return reach


def measured_error(errors: LayerErrors, ranks: dict[tuple[int, str], int]) -> float:
    """Σ load · mean over routed tokens of ‖(E − L·R)·x‖², computed directly (not from the spectrum)."""
    total = 0.0
    for key, spectrum in errors.spectra.items():
        residual = _residual(errors.errors[key], spectrum, ranks.get(key, 0))
        total += errors.loads[key] * _output_error(errors.inputs[key], residual)
    return total
