"""Quantising one MoE block's routed experts: round-to-nearest, or, calibrated, GPTQ with each expert's Hessian
and the choice of its salient weights both built from the calibration tokens the router actually sends it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from ..device import moe_on
from ..families import FamilyAdapter, MoEWeights
from . import salient
from .gptq import DEFAULT_BLOCK, DEFAULT_DAMP, gptq_quantize
from .salient import SalientWeights
from .scheme import QuantizedTensor, QuantScheme

GPTQ_EXPERTS_AT_ONCE = 8
"""Experts whose GPTQ runs together: their float64 Hessians (8 x 2048² x 8 B = 268 MB on Qwen3-30B-A3B) instead of
the whole layer's (4.3 GB)."""


@dataclass
class QuantizedMoE:
    """A block whose routed experts are quantised; ``weights`` keeps the router, biases and expert ids (its own
    ``gate_up`` and ``down`` are the unquantised originals)."""

    weights: MoEWeights
    gate_up: QuantizedTensor
    down: QuantizedTensor
    stats: dict = field(default_factory=dict)
    adapters: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Low-rank error adapters ``(L, R)`` keyed by ``(expert position, "gate" | "up" | "down")``."""
    _dequantized: MoEWeights | None = field(default=None, repr=False, compare=False)

    def dequantized(self) -> MoEWeights:
        """The block as it computes after quantisation (what the next layer's calibration should see); computed
        once, since GPTQ's propagation and the low-rank errors both need it."""
        if self._dequantized is None:
            self._dequantized = replace(self.weights, gate_up=self.gate_up.dequantize(), down=self.down.dequantize())
        return self._dequantized

    def dequantized_expert(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's dequantised ``gate_up [2I, H]`` and ``down [H, I]`` (float32), without dequantising the
        block: a Qwen3-30B block is 2.4 GB in float32, one expert 19 MB."""
        if self._dequantized is not None:
            return self._dequantized.gate_up[expert], self._dequantized.down[expert]
        return self.gate_up[expert].dequantize(), self.down[expert].dequantize()


def quantize_experts_rtn(moe: MoEWeights, scheme: QuantScheme) -> QuantizedMoE:
    gate_up, down = scheme.quantize(moe.gate_up), scheme.quantize(moe.down)
    return QuantizedMoE(moe, gate_up, down, {"method": "rtn"})


def routed_tokens(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    hidden: torch.Tensor,
    router_input: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    sequence_lengths: list[int] | None = None,
) -> list[torch.Tensor]:
    """For each expert (position in ``moe``), the indices of the tokens in ``hidden`` routed to it (the router reads
    ``router_input`` where the family's router has an input of its own; a hash-routed block routes by the tokens'
    ids ``token_ids``; a family that routes whole sequences, by ``hidden``'s ``sequence_lengths``)."""
    ids, _ = route_tokens(adapter, moe, hidden, router_input, token_ids, sequence_lengths)
    return [torch.where((ids == expert).any(dim=-1))[0] for expert in range(moe.num_experts)]


def route_tokens(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    hidden: torch.Tensor,
    router_input: torch.Tensor | None,
    token_ids: torch.Tensor | None,
    sequence_lengths: list[int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's choice ``(ids, weights)`` for ``hidden``; with ``sequence_lengths`` (a family that routes whole
    sequences), a choice its sequence's rule takes away gets id -1."""
    logits = adapter.router_logits(moe, hidden if router_input is None else router_input)
    ids, weights = adapter.route(moe, logits, token_ids=token_ids)
    if sequence_lengths is None:
        return ids, weights
    weights = adapter.sequence_routing(moe, ids, weights, sequence_lengths)
    return ids.masked_fill(weights == 0, -1), weights


def routed_inputs(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    hidden: torch.Tensor,
    router_input: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    sequence_lengths: list[int] | None = None,
) -> list[torch.Tensor]:
    """For each expert (position in ``moe``), what it computes on: the tokens of ``hidden`` routed to it, scaled by
    their routing weight where the family's rule scales expert inputs (Llama 4); a hash-routed block routes by the
    tokens' ids ``token_ids``; a family that routes whole sequences, by ``hidden``'s ``sequence_lengths``."""
    rule = adapter.routing_rule()
    ids, weights = route_tokens(adapter, moe, hidden, router_input, token_ids, sequence_lengths)
    inputs = []
    for expert in range(moe.num_experts):
        token, slot = torch.where(ids == expert)
        inputs.append(rule.expert_input(hidden[token], weights[token, slot, None]))
    return inputs


def input_importance(inputs: list[torch.Tensor], width: int, use: list[bool]) -> torch.Tensor:
    """Per expert, each input column's mean square over its routed tokens (GPTQ's Hessian diagonal, normalised to
    mean 1, floored at 1e-6) ``[E, 1, width]``; 1 for experts that fall back to plain RTN."""
    importance = torch.ones(len(inputs), 1, width)
    for expert, x in enumerate(inputs):
        if use[expert]:
            second = x.double().pow(2).mean(dim=0).float().cpu()
            mean = second.mean()
            if mean > 0:
                importance[expert, 0] = (second / mean).clamp_min(1e-6)
    return importance


def _hessians(inputs: list[torch.Tensor], width: int, use: list[bool]) -> torch.Tensor:
    """``XᵀX`` per expert in float64 accumulation; the identity for experts that fall back to RTN."""
    device = inputs[0].device if inputs else "cpu"
    hessians = torch.empty(len(inputs), width, width, device=device)
    for expert, x in enumerate(inputs):
        if use[expert]:
            x = x.double()
            hessians[expert] = (x.T @ x).float()
        else:
            hessians[expert] = torch.eye(width, device=device)
    return hessians


def _quantize_matrix(
    weight: torch.Tensor,
    inputs: list[torch.Tensor],
    scheme: QuantScheme,
    use_gptq: list[bool] | None,
    damp: float,
    block_size: int,
) -> QuantizedTensor:
    """One fused expert matrix ``[E, rows, cols]``: salient weights chosen from its routed ``inputs`` (if the
    scheme keeps any), then GPTQ (``use_gptq`` says per expert whether its Hessian is used) or RTN."""
    width = weight.shape[-1]
    keep = None
    if scheme.salient_fraction:
        keep = salient.choose(weight, salient.input_rms(inputs, width), scheme.salient_fraction)
    if use_gptq is None:
        return scheme.quantize(weight, keep)
    if not scheme.kind.gptq:
        return scheme.quantize(weight, keep, importance=input_importance(inputs, width, use_gptq))
    parts = []
    for start in range(0, weight.shape[0], GPTQ_EXPERTS_AT_ONCE):
        stop = min(start + GPTQ_EXPERTS_AT_ONCE, weight.shape[0])
        hessians = _hessians(inputs[start:stop], width, use_gptq[start:stop])
        part = weight[start:stop].float()
        part_keep = None if keep is None else keep[start:stop]
        parts.append(gptq_quantize(part, hessians, scheme, block_size=block_size, damp=damp, keep=part_keep))
        del hessians
    return _concatenate(parts)


def _concatenate(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Expert-chunks of one fused matrix, in order, as one :class:`QuantizedTensor`."""
    first = parts[0]
    if len(parts) == 1:
        return first
    salient = None
    if first.salient is not None:
        offsets, positions = 0, []
        for part in parts:
            positions.append(part.salient.positions + offsets)
            offsets += part.numel
        salient = SalientWeights(torch.cat(positions), torch.cat([part.salient.values for part in parts]))
    return QuantizedTensor(
        first.scheme,
        (sum(part.shape[0] for part in parts), *first.shape[1:]),
        torch.cat([part.packed for part in parts]),
        torch.cat([part.scales for part in parts]),
        None if first.zeros is None else torch.cat([part.zeros for part in parts]),
        salient,
    )


def quantize_experts_calibrated(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    hidden: torch.Tensor,
    scheme: QuantScheme,
    *,
    method: str = "gptq",
    min_tokens: int = 64,
    damp: float = DEFAULT_DAMP,
    block_size: int = DEFAULT_BLOCK,
    router_input: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    sequence_lengths: list[int] | None = None,
) -> QuantizedMoE:
    """Quantise every routed expert of ``moe`` using the block's calibration inputs ``hidden`` ``[T, H]``: GPTQ
    (``method="gptq"``) and/or the choice of salient weights (schemes with a salient fraction).

    ``gate_up`` is quantised first; the inputs of ``down`` are then computed through the *quantised* ``gate_up``
    so the second matrix corrects the first one's error too, and its salient weights are chosen on what it will
    really see. Under GPTQ, experts routed fewer than ``min_tokens`` tokens fall back to round-to-nearest (an
    identity Hessian) and are listed in ``stats["rtn_fallback"]``; experts routed no token at all choose their
    salient weights by magnitude alone (``stats["salient_by_magnitude"]``).
    """
    if method not in ("gptq", "rtn"):
        raise ValueError(f"unknown method {method!r}")
    hidden = hidden.float()
    moe = moe_on(moe, hidden.device)
    router_input = None if router_input is None else router_input.to(hidden.device)
    inputs = routed_inputs(adapter, moe, hidden, router_input, token_ids, sequence_lengths)
    counts = [int(x.shape[0]) for x in inputs]
    use = [count >= min_tokens for count in counts] if method == "gptq" else None
    gate_up = _quantize_matrix(moe.gate_up, inputs, scheme, use, damp, block_size)
    activations = []
    for expert, x in enumerate(inputs):
        projected = F.linear(x, gate_up[expert].dequantize())
        if moe.gate_up_bias is not None:
            projected = projected + moe.gate_up_bias[expert].float()
        activations.append(adapter.expert_hidden(projected, moe.intermediate_size, moe.layer))
    down = _quantize_matrix(moe.down, activations, scheme, use, damp, block_size)
    ran = method if method == "rtn" or scheme.kind.gptq else "importance-weighted rtn"
    stats: dict = {"method": ran, "tokens_per_expert": dict(zip(moe.expert_ids, counts, strict=True))}
    if use is not None:
        stats["rtn_fallback"] = [eid for eid, used in zip(moe.expert_ids, use, strict=True) if not used]
    if scheme.salient_fraction:
        stats["salient_weights"] = {"gate_up": gate_up.salient.count, "down": down.salient.count}
        stats["salient_by_magnitude"] = [eid for eid, count in zip(moe.expert_ids, counts, strict=True) if not count]
    return QuantizedMoE(moe, gate_up, down, stats)
