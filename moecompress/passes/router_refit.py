"""Router recalibration: refit a compressed MoE block's router so its routed output reproduces the original block's.

After experts are removed (or merged) the surviving router rows still score tokens as they did beside the experts
that are gone, so the tokens those experts served are re-routed by rows that were never trained for it. The rows
(and the router bias where the family has one) are refitted by a few steps of distillation on the layer's
calibration tokens: Adam on minibatches with a cosine-decaying step, minimising the mean ‖moe_c(x) − moe_ref(x)‖².
The top-k choice is discrete, so the gradient reaches the router through the routing weights of the chosen experts;
their outputs are computed without grad (the expert weights are frozen), only for the chosen (token, expert) pairs,
so memory stays one minibatch of routed outputs besides the reference output. Where the family's rule scales an
expert's input rather than its output (Llama 4), the gradient goes through the frozen expert.

The correction bias and per-expert scale stay as they are. The full-token error is measured on the rows as they
will be stored (cast back to the router's dtype) before the first step, every ``eval_every`` steps and after the
last; the best rows seen are returned, the original tensors themselves when no step beats them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Any

import torch

from ..device import moe_on
from ..families import FamilyAdapter, MoEWeights

DEFAULT_STEPS = 150
DEFAULT_LR = 1e-2
"""Adam's step size relative to the router's scale: the weight rows' RMS entry, and for the bias the spread of
the logits."""
DEFAULT_BATCH_TOKENS = 1024
DEFAULT_EVAL_EVERY = 50
CHUNK_TOKENS = 2048


def recalibrate_router(
    adapter: FamilyAdapter,
    reference: MoEWeights,
    compressed: MoEWeights,
    hidden: torch.Tensor,
    router_input: torch.Tensor | None = None,
    *,
    steps: int = DEFAULT_STEPS,
    lr: float = DEFAULT_LR,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    eval_every: int = DEFAULT_EVAL_EVERY,
    seed: int = 0,
    chunk_tokens: int = CHUNK_TOKENS,
    token_ids: torch.Tensor | None = None,
    sequence_lengths: list[int] | None = None,
) -> tuple[MoEWeights, dict[str, Any]]:
    """``compressed`` with its router rows (and bias) fitted so that its routed output on the tokens ``hidden``
    ``[T, H]`` (the router reads ``router_input`` where the family's router has an input of its own; hash-routed
    blocks route by the tokens' ids ``token_ids``; a family that routes whole sequences, by ``hidden``'s
    ``sequence_lengths``: the minibatches are then whole sequences) is as close as the fit gets to ``reference``'s,
    and a report: the relative error ‖Δ‖²/‖ref‖² over all tokens before and after, the step whose rows were kept
    (0: the original rows), steps, tokens, lr, batch size, and ``history``: ``[step, error]`` of every
    measurement."""
    tokens = hidden.shape[0]
    if tokens == 0:
        raise ValueError("router recalibration needs at least one calibration token")
    if router_input is not None and router_input.shape[0] != tokens:
        raise ValueError(f"router_input holds {router_input.shape[0]} tokens, hidden {tokens}")
    if steps < 0 or lr <= 0 or batch_tokens < 1 or eval_every < 1 or chunk_tokens < 1:
        raise ValueError("steps must be >= 0, lr > 0, batch_tokens, eval_every and chunk_tokens >= 1")
    device = hidden.device
    x = hidden.float()
    routed_by = None if router_input is None else router_input.to(device).float()
    moe = moe_on(compressed, device)
    pieces = _pieces(tokens, chunk_tokens, sequence_lengths)
    target = _routed_output(adapter, moe_on(reference, device), x, routed_by, pieces, token_ids=token_ids)
    energy = sum(target[rows].double().pow(2).sum() for rows in pieces)
    energy = energy.clamp_min(torch.finfo(torch.float64).tiny)

    def error(candidate: MoEWeights) -> float:
        return float(_squared_error(adapter, candidate, x, routed_by, target, pieces, token_ids) / energy)

    before = best = error(moe)
    history = [[0, before]]
    best_rows: tuple[torch.Tensor, torch.Tensor | None] | None = None
    best_step = 0
    weight = moe.router_weight.detach().float().clone().requires_grad_(True)
    bias = None if moe.router_bias is None else moe.router_bias.detach().float().clone().requires_grad_(True)
    optimizer = _optimizer(adapter, moe, weight, bias, x if routed_by is None else routed_by, lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda done: 0.5 * (1 + math.cos(math.pi * done / max(steps, 1)))
    )
    batches = (
        _token_batches(tokens, batch_tokens, seed, device)
        if sequence_lengths is None
        else _sequence_batches(sequence_lengths, batch_tokens, seed, device)
    )
    mean_energy = (energy / tokens).float()
    expert_grad = adapter.routing_rule().scales_input
    for step in range(1, steps + 1):
        index, lengths = next(batches)
        fitted = replace(moe, router_weight=weight, router_bias=bias)
        batch_router_input = None if routed_by is None else routed_by[index]
        batch_token_ids = None if token_ids is None else token_ids.to(index.device)[index]
        out = _routed_output(adapter, fitted, x[index], batch_router_input, None, expert_grad, batch_token_ids, lengths)
        loss = (out - target[index]).pow(2).sum(dim=-1).mean() / mean_energy
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % eval_every and step != steps:
            continue
        rows = _stored(weight, moe.router_weight), None if bias is None else _stored(bias, moe.router_bias)
        now = error(replace(moe, router_weight=rows[0], router_bias=rows[1]))
        history.append([step, now])
        if now < best:
            best, best_rows, best_step = now, rows, step
    report = {
        "error_before": before,
        "error_after": best,
        "best_step": best_step,
        "steps": steps,
        "tokens": tokens,
        "lr": lr,
        "batch_tokens": batch_tokens,
        "history": history,
    }
    if best_rows is None:
        return compressed, report
    home = compressed.router_weight.device
    refit = replace(
        compressed,
        router_weight=best_rows[0].to(home),
        router_bias=None if best_rows[1] is None else best_rows[1].to(home),
    )
    return refit, report


def _stored(fitted: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    return fitted.detach().to(original.dtype).clone()


def _optimizer(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    routed_by: torch.Tensor,
    lr: float,
) -> torch.optim.Adam:
    """Adam moves every entry by about its step size, so the step sizes are ``lr`` times the scale of what they
    move: the weight's RMS entry, and for the bias the logits' standard deviation over the calibration tokens."""
    groups = [{"params": [weight], "lr": lr * _scale(weight.detach().pow(2).mean().sqrt())}]
    if bias is not None:
        with torch.no_grad():
            sample = routed_by[:CHUNK_TOKENS]
            logits = adapter.router_logits(replace(moe, router_bias=None), sample)
        groups.append({"params": [bias], "lr": lr * _scale(logits.std() if logits.numel() > 1 else logits.abs())})
    return torch.optim.Adam(groups)


def _scale(value: torch.Tensor) -> float:
    value = float(value)
    return value if value > 0 and value == value else 1.0


def _token_batches(tokens: int, batch_tokens: int, seed: int, device: torch.device):
    """Minibatches ``(token indices, None)``: each pass over the tokens in a seeded random order, forever."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    size = min(batch_tokens, tokens)
    while True:
        order = torch.randperm(tokens, generator=generator)
        for start in range(0, tokens - size + 1, size):
            yield order[start : start + size].to(device), None


def _sequence_batches(lengths: list[int], batch_tokens: int, seed: int, device: torch.device):
    """Minibatches ``(token indices, sequence lengths)`` of whole sequences, about ``batch_tokens`` tokens (at least
    one sequence) each: each pass over the sequences in a seeded random order, forever."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    starts = [0, *itertools.accumulate(lengths)]
    size = min(batch_tokens, starts[-1])
    while True:
        batch: list[int] = []
        for sequence in torch.randperm(len(lengths), generator=generator).tolist():
            batch.append(sequence)
            if sum(lengths[i] for i in batch) >= size:
                yield _sequence_rows(batch, starts, device), [lengths[i] for i in batch]
                batch = []


def _sequence_rows(sequences: list[int], starts: list[int], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(starts[i], starts[i + 1]) for i in sequences]).to(device)


def _pieces(tokens: int, chunk_tokens: int, sequence_lengths: list[int] | None) -> list[slice]:
    """The token ranges the family's forward runs on at once: chunks of ``chunk_tokens``, or each sequence."""
    if sequence_lengths is None:
        return [slice(s, s + chunk_tokens) for s in range(0, tokens, chunk_tokens)]
    starts = [0, *itertools.accumulate(sequence_lengths)]
    return [slice(start, end) for start, end in itertools.pairwise(starts)]


def _routed_output(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    x: torch.Tensor,
    routed_by: torch.Tensor | None,
    pieces: list[slice] | None,
    expert_grad: bool = False,
    token_ids: torch.Tensor | None = None,
    lengths: list[int] | None = None,
) -> torch.Tensor:
    """The block's routed output for ``x`` (whole sequences of ``lengths`` for a family that routes them); the
    router's tensors carry their grad, the experts' computation only with ``expert_grad``. With ``pieces`` it is
    the family's own forward without grad, one piece at a time (:func:`_pieces`)."""
    if pieces is not None:
        out = torch.empty_like(x)
        with torch.no_grad():
            for rows in pieces:
                out[rows] = adapter.moe_forward(
                    moe, x[rows], router_input=_rows(routed_by, rows), token_ids=_rows(token_ids, rows)
                )
        return out
    logits = adapter.router_logits(moe, x if routed_by is None else routed_by)
    ids, weights = adapter.route(moe, logits, token_ids=token_ids)
    if lengths is not None:
        weights = adapter.sequence_routing(moe, ids, weights, lengths)

    def output_of(expert: int, expert_input: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(expert_grad and torch.is_grad_enabled()):
            return adapter.expert_output(moe, expert, expert_input)

    return adapter.combine_experts(x, ids, weights, output_of)


def _squared_error(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    x: torch.Tensor,
    routed_by: torch.Tensor | None,
    target: torch.Tensor,
    pieces: list[slice],
    token_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    with torch.no_grad():
        for rows in pieces:
            out = adapter.moe_forward(
                moe, x[rows], router_input=_rows(routed_by, rows), token_ids=_rows(token_ids, rows)
            )
            total += (out - target[rows]).double().pow(2).sum()
    return total


def _rows(tensor: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if tensor is None else tensor[rows]
