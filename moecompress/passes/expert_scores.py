"""Per-expert statistics of one MoE layer from its calibration capture: frequency, REAP and Delta-H.

Delta-H (ΔH) of expert e for token t is ‖H_t − H'_t(e)‖, where H_t is the routed experts' combined output and
H'_t(e) the output once e is removed *and t is re-routed* among the remaining experts by the family's own rule
(the next best expert enters the top-k; weights renormalised as the family renormalises). It comes from one pass
over the layer's tokens: the router is re-evaluated with each expert masked (cheap: logits only), and the only
new expert outputs computed are those of experts that enter a token's top-k when another leaves it — for
softmax top-k rules exactly the (k+1)-th choice.

Where the family's rule scales the expert's input rather than its output (Llama 4), f_e(x) is the expert's output on
the scaled token and its output weight is 1: REAP is then the mean of ‖f_e(w·x)‖ over the routed tokens.

Identity experts (LongCat-Flash's zero-computation experts, router columns past the FFN experts) route and re-route
like the others with f(x) = x; they are never removed, so they get no ΔH, and their frequency and REAP are kept apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..device import moe_on
from ..families import FamilyAdapter, MoEWeights


@dataclass
class TokenExpertStats:
    """Per token and expert quantities of one layer (``T`` tokens, ``E`` experts)."""

    frequency: torch.Tensor  # [E] fraction of tokens whose top-k holds e
    reap: torch.Tensor  # [E] mean over routed tokens of gate weight × ‖f_e(x)‖ (0 if never routed)
    delta_h: torch.Tensor  # [T, E] ‖ΔH‖ per token and expert
    output_norm: torch.Tensor  # [T] ‖H_t‖
    routed_counts: torch.Tensor  # [E]
    reap_sum: torch.Tensor  # [E] sum over routed tokens of gate weight × ‖f_e(x)‖ (float64)
    identity_counts: torch.Tensor | None = None  # [Z] tokens routed to each identity expert
    identity_reap_sum: torch.Tensor | None = None  # [Z] as reap_sum, for the identity experts


def _expert_outputs(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    hidden: torch.Tensor,
    pairs_token: torch.Tensor,
    pairs_expert: torch.Tensor,
    pairs_weight: torch.Tensor | None,
) -> torch.Tensor:
    """Outputs f_j(x_t) for the (t, j) pairs given, ``[P, H]``, not multiplied by the routing weight; where the
    family's rule scales expert inputs, x_t is the token scaled by its pair's weight ``pairs_weight`` ``[P, 1]``."""
    rule = adapter.routing_rule()
    out = torch.empty(pairs_token.numel(), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    for expert in pairs_expert.unique().tolist():
        where = (pairs_expert == expert).nonzero().squeeze(1)
        weight = None if pairs_weight is None else pairs_weight[where]
        out[where] = adapter.expert_output(moe, expert, rule.expert_input(hidden[pairs_token[where]], weight))
    return out


def layer_expert_stats(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    hidden: torch.Tensor,
    chunk_tokens: int = 2048,
    removed: torch.Tensor | None = None,
    router_input: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    sequence_lengths: list[int] | None = None,
) -> TokenExpertStats:
    """Frequency, REAP and single-pass ΔH of every expert over the tokens ``hidden`` ``[T, H]`` (the router reads
    ``router_input`` where the family's router has an input of its own; a hash-routed block routes by the tokens'
    ids ``token_ids``, each removed expert's entries redirected as its table's rule says). Where the family routes
    whole sequences (:attr:`FamilyAdapter.per_sequence_routing`), ``sequence_lengths`` are those of ``hidden``'s
    sequences: each chunk holds whole sequences, and a token its sequence's rule takes from its expert (weight 0) is
    not counted as that expert's.

    ``removed`` (bool ``[E]``) marks experts already taken out: routing avoids them, and ΔH of the others is the
    change from that reduced block. Removed experts get ΔH 0.
    """
    rule = adapter.routing_rule()
    device = hidden.device
    moe = moe_on(moe, device)
    num_experts, columns = moe.num_experts, moe.router_columns
    tokens = hidden.shape[0]
    counts = torch.zeros(columns, device=device)
    reap_sum = torch.zeros(columns, dtype=torch.float64, device=device)
    delta_h = torch.zeros(tokens, num_experts, device=device)
    output_norm = torch.zeros(tokens, device=device)
    eye = torch.eye(columns, dtype=torch.bool, device=device)
    present = torch.ones(columns, dtype=torch.bool, device=device)
    if removed is not None:
        present[:num_experts] = ~removed.to(device)
    base_allowed = None if removed is None else present
    for start, end, lengths in _chunks(tokens, chunk_tokens, sequence_lengths):
        x = hidden[start:end].float()
        n = x.shape[0]
        routed_by = x if router_input is None else router_input[start:end].to(device).float()
        logits = adapter.router_logits(moe, routed_by)
        chunk_ids = None if token_ids is None else token_ids[start:end]

        def route(allowed, chunk_ids=chunk_ids, logits=logits, lengths=lengths):
            ids, weights = adapter.route(moe, logits, allowed=allowed, token_ids=chunk_ids)
            return (ids, weights) if lengths is None else (ids, adapter.sequence_routing(moe, ids, weights, lengths))

        ids, weights = route(base_allowed)
        # every present expert removed in turn: [E, n, k] re-routed ids and weights
        masked = [route(present & ~eye[e]) if present[e] else (ids, weights) for e in range(num_experts)]
        new_ids = torch.stack([m[0] for m in masked])
        new_weights = torch.stack([m[1] for m in masked])

        needed = torch.zeros(n, columns, dtype=torch.bool, device=device)
        needed.scatter_(1, ids, True)
        changed = (new_ids.sort(dim=-1).values != ids.sort(dim=-1).values[None]).any(-1) | ~torch.isclose(
            new_weights.sort(dim=-1).values, weights.sort(dim=-1).values[None], rtol=1e-6, atol=1e-9
        ).all(-1)  # [E, n]
        for e in range(num_experts):
            rows = changed[e].nonzero().squeeze(1)
            if rows.numel():
                needed[rows[:, None], new_ids[e, rows]] = True
        pair_token, pair_expert = needed.nonzero(as_tuple=True)
        # A rule that scales inputs weighs an expert by its own logit alone, so one weight per pair serves every
        # routing; other rules never read it.
        pair_weight = rule.weights_for(logits[pair_token], pair_expert[:, None]) if rule.scales_input else None
        outputs = _expert_outputs(adapter, moe, x, pair_token, pair_expert, pair_weight)
        index = torch.full((n, columns), -1, dtype=torch.long, device=device)
        index[pair_token, pair_expert] = torch.arange(pair_token.numel(), device=device)

        token_rows = torch.arange(n, device=device)[:, None]
        routed = outputs[index[token_rows, ids]]  # [n, k, H]
        combined = (rule.output_weight(weights)[..., None] * routed).sum(dim=1)  # H_t
        output_norm[start : start + n] = combined.norm(dim=-1)
        gate_norm = rule.output_weight(weights) * routed.norm(dim=-1)  # [n, k]
        counted = (ids if lengths is None else ids.masked_fill(weights == 0, columns)).reshape(-1)
        counts += torch.bincount(counted, minlength=columns + 1)[:columns].float()
        reap_sum += torch.bincount(counted, weights=gate_norm.reshape(-1).double(), minlength=columns + 1)[:columns]
        for e in range(num_experts):
            rows = changed[e].nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            rerouted = outputs[index[rows[:, None], new_ids[e, rows]]]  # [r, k, H]
            new_combined = (rule.output_weight(new_weights[e, rows])[..., None] * rerouted).sum(dim=1)
            delta_h[start + rows, e] = (combined[rows] - new_combined).norm(dim=-1)
    identity = slice(num_experts, columns)
    counts, identity_counts = counts[:num_experts], counts[identity] if moe.identity_experts else None
    reap_sum, identity_reap_sum = reap_sum[:num_experts], reap_sum[identity] if moe.identity_experts else None
    return TokenExpertStats(
        frequency=counts / tokens,
        reap=torch.where(counts > 0, reap_sum / counts.clamp_min(1), 0.0).float(),
        delta_h=delta_h,
        output_norm=output_norm,
        routed_counts=counts,
        reap_sum=reap_sum,
        identity_counts=identity_counts,
        identity_reap_sum=identity_reap_sum,
    )


def _chunks(tokens: int, chunk_tokens: int, sequence_lengths: list[int] | None):
    """``(start, end, lengths of the sequences in it or None)`` of each chunk of at most ``chunk_tokens`` tokens (at
    least one sequence when ``sequence_lengths`` is given: chunks then end at sequence ends)."""
    if sequence_lengths is None:
        for start in range(0, tokens, chunk_tokens):
            yield start, min(start + chunk_tokens, tokens), None
        return
    start, lengths = 0, []
    for length in sequence_lengths:
        if lengths and sum(lengths) + length > chunk_tokens:
            yield start, start + sum(lengths), lengths
            start, lengths = start + sum(lengths), []
        lengths.append(length)
    if lengths:
        yield start, start + sum(lengths), lengths


def brute_force_delta_h(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    hidden: torch.Tensor,
    router_input: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """ΔH by re-running the whole block once per removed expert (the definition; for tests)."""
    routing = dict(router_input=router_input, token_ids=token_ids)
    full = adapter.moe_forward(moe, hidden.float(), allowed=None, **routing)
    eye = torch.eye(moe.router_columns, dtype=torch.bool, device=hidden.device)
    return torch.stack(
        [
            (full - adapter.moe_forward(moe, hidden.float(), allowed=~eye[e], **routing)).norm(dim=-1)
            for e in range(moe.num_experts)
        ],
        dim=1,
    )
