"""Expert merging (HC-SMoE style): experts grouped by what they compute on the calibration tokens, each group merged
into one expert of the same architecture.

- :func:`expert_signatures`: every expert's output on one fixed, evenly spaced subsample of the tokens, flattened and
  L2-normalised: experts that compute the same function on the data have close signatures.
- :func:`merge_tree` and :func:`cut_tree`: average-linkage agglomerative clustering of the signatures under cosine
  distance, cut to the number of experts to keep (per router group for group-limited routers).
- :func:`merge_experts`: one expert per group: the members' intermediate neurons aligned to the most used member's,
  averaged with their routed-token counts as weights, the down projection refitted by ridge least squares on the
  group's routed tokens, and the group's router rows averaged with the same weights.

All math is float32 (sums of squares and the normal equations float64) and deterministic; tokens are processed in
chunks, so memory stays about one layer's weights.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from ..device import moe_on
from ..errors import UserInputError
from ..families import FamilyAdapter, MoEWeights
from ..families.token_table import merged as merged_table

RIDGE = 1e-4
"""The refit's ridge: λ = RIDGE · trace(AᵀA) / I (A: the merged expert's intermediate activations, token-weighted)."""


def expert_signatures(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    hidden: torch.Tensor,
    router_input: torch.Tensor | None = None,
    tokens: int = 512,
) -> torch.Tensor:
    """``[E, min(tokens, T) * H]``: each expert's output on the tokens ``hidden`` ``[T, H]`` at positions
    ``i * T // n`` (``n`` of them), flattened and L2-normalised.

    The outputs are unweighted. Where the family's rule scales an expert's input (Llama 4), expert e sees each token
    scaled by the weight its router would give it (from ``router_input`` where the router has an input of its own).
    """
    total = hidden.shape[0]
    if total == 0:
        raise ValueError("expert signatures need at least one token")
    count = min(tokens, total)
    device = hidden.device
    work = moe_on(moe, device)
    rule = adapter.routing_rule()
    picks = torch.arange(count, device=device) * total // count
    x = hidden[picks].float()
    logits = None
    if rule.scales_input:
        routed_by = x if router_input is None else router_input[picks].to(device).float()
        logits = adapter.router_logits(work, routed_by)
    out = torch.empty(work.num_experts, count * x.shape[1], device=device)
    for expert in range(work.num_experts):
        inputs = x if logits is None else rule.expert_input(x, _solo_weight(adapter, work, logits, expert))
        out[expert] = adapter.expert_output(work, expert, inputs).float().reshape(-1)
    return F.normalize(out, dim=1)


def _solo_weight(adapter: FamilyAdapter, moe: MoEWeights, logits: torch.Tensor, expert: int) -> torch.Tensor:
    """``[T, 1]``: the weight the router gives ``expert`` when it chooses it, for rules whose weight of an expert
    depends on its own logit alone (those that scale inputs)."""
    ids = torch.full((logits.shape[0], 1), expert, dtype=torch.long, device=logits.device)
    weight = adapter.routing_rule().weights_for(logits, ids)
    if moe.expert_scale is not None:
        weight = weight * moe.expert_scale[expert].float()
    return weight


def merge_tree(signatures: torch.Tensor, *, group_size: int | None = None) -> list[tuple[int, int]]:
    """Average-linkage agglomerative clustering of ``signatures`` ``[E, D]`` (rows L2-normalised) under cosine
    distance ``1 - s_i·s_j``.

    Scipy's linkage convention: leaves are ``0..E-1``; merge ``m`` joins clusters ``(a, b)`` (``a < b``) into
    cluster ``E + m``. Each step joins the closest pair (ties: the first in row-major order of the active clusters'
    distance matrix). Without ``group_size`` that is ``E - 1`` merges. With ``group_size`` (consecutive router groups
    of that many experts, DeepSeek's ``n_group``) experts merge only within their group: one tree per group, the
    groups' merges one group after the other (``group_size - 1`` each, ``E - E/group_size`` in all), so a cut that
    takes the first merges of each group's own sequence leaves every group the same count (:func:`cut_tree`).
    """
    total = signatures.shape[0]
    size = _group_size(total, group_size)
    merges: list[tuple[int, int]] = []
    for start in range(0, total, size):
        merges += _average_linkage(signatures[start : start + size].float(), start, total + len(merges))
    return merges


def _group_size(total: int, group_size: int | None) -> int:
    size = total if group_size is None else group_size
    if size < 1 or total % size:
        raise ValueError(f"router groups of {group_size} experts do not divide {total} experts")
    return size


def _average_linkage(unit: torch.Tensor, first_leaf: int, first_new: int) -> list[tuple[int, int]]:
    """The merges of the leaves ``first_leaf..`` (rows of ``unit``), new clusters numbered from ``first_new``."""
    count = unit.shape[0]
    similarity = (unit @ unit.T).double()
    dist = (1.0 - (similarity + similarity.T) / 2).clamp_min(0.0)
    dist.fill_diagonal_(float("inf"))
    sizes = [1] * count
    label = list(range(first_leaf, first_leaf + count))
    merges = []
    for step in range(count - 1):
        i, j = divmod(int(torch.argmin(dist)), count)
        merges.append((min(label[i], label[j]), max(label[i], label[j])))
        joined = (sizes[i] * dist[i] + sizes[j] * dist[j]) / (sizes[i] + sizes[j])
        dist[i], dist[:, i] = joined, joined
        dist[j], dist[:, j] = float("inf"), float("inf")
        dist[i, i] = float("inf")
        sizes[i] += sizes[j]
        label[i] = first_new + step
    return merges


def cut_tree(
    merges: list[tuple[int, int]], num_experts: int, keep: int, *, group_size: int | None = None
) -> list[list[int]]:
    """The tree of :func:`merge_tree` cut to ``keep`` groups of expert positions: each group sorted, groups ordered
    by their smallest member. With ``group_size`` each router group keeps ``keep / (num_experts / group_size)``:
    each group's first merges (in the list's order) are applied until it has that many."""
    size = _group_size(num_experts, group_size)
    router_groups = num_experts // size
    if not router_groups <= keep <= num_experts or keep % router_groups:
        where = f" in {router_groups} router groups of {size}" if router_groups > 1 else ""
        raise UserInputError(
            f"expert merging: cannot keep {keep} of {num_experts} experts{where} "
            f"(keep a multiple of {router_groups} between {router_groups} and {num_experts})"
        )
    to_apply = size - keep // router_groups
    members = {expert: [expert] for expert in range(num_experts)}
    group_of = {expert: expert // size for expert in range(num_experts)}
    applied = [0] * router_groups
    for step, (a, b) in enumerate(merges):
        if a not in group_of or b not in group_of or group_of[a] != group_of[b]:
            raise ValueError(f"merge {step} ({a}, {b}) joins unknown clusters or crosses router groups")
        group = group_of[num_experts + step] = group_of[a]
        if applied[group] < to_apply:
            if a not in members or b not in members:
                raise ValueError(f"merge {step} ({a}, {b}) joins a cluster already merged")
            members[num_experts + step] = members.pop(a) + members.pop(b)
            applied[group] += 1
    if any(done != to_apply for done in applied):
        raise ValueError(f"the tree has too few merges to keep {keep} of {num_experts} experts")
    return sorted(sorted(group) for group in members.values())


def merge_experts(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    groups: list[list[int]],
    hidden: torch.Tensor,
    router_input: torch.Tensor | None = None,
    *,
    refit: bool = True,
    chunk_tokens: int = 2048,
    token_ids: torch.Tensor | None = None,
    sequence_lengths: list[int] | None = None,
) -> tuple[MoEWeights, list[dict[str, Any]]]:
    """The block with one expert per group of expert positions (in group order; experts in no group are dropped),
    and one report per group.

    Tokens ``hidden`` ``[T, H]`` are routed by the unmerged block (its router reads ``router_input`` where given; a
    hash-routed block routes by the tokens' ids ``token_ids``, and its table's entries of a group's members name the
    group's merged expert: :func:`~moecompress.families.token_table.merged`; a family that routes whole sequences,
    by ``hidden``'s ``sequence_lengths``, a token its expert's capacity drops routed to none).
    A group of one is that expert, tensors untouched. Otherwise, with ``n_j`` the tokens routed to member j:

    - anchor: the member with the largest ``n_j`` (ties: the first); the merged expert takes its id;
    - alignment: each other member's intermediate neurons are permuted to match the anchor's by greedy matching
      (repeatedly the most similar free pair) of the Pearson correlation of their intermediate activations on the
      group's routed tokens, or, where fewer tokens than neurons were routed to the group, of the cosine of their
      weights (gate row, up row, biases, down column);
    - gate/up, down and their biases: the aligned members' mean weighted by ``n_j`` (uniform if none was routed);
      the router rows, router bias, correction bias and expert scale: the same weighted mean; identity-expert
      router columns are kept, after the merged experts';
    - refit (``refit``, and at least as many routed tokens as neurons): on the group's routed tokens, with ``w_tj``
      the weight that multiplies member j's output on token t (the rule's output weight), the merged expert's down
      projection (and down bias) solve the ridge least squares ``Σ_t (Σ_j w_tj)² ‖f(x_t) - y_t‖²``,
      ``y_t = Σ_j w_tj f_j(x_t) / Σ_j w_tj`` (sums over the group's members in t's top-k), ridge
      ``RIDGE · trace(AᵀA) / I`` on the neurons (not the bias). Where the rule scales expert inputs (Llama 4), the
      merged expert's input is the token scaled by its chosen members' mean weight.

    Each report: ``members`` (ids), ``anchor`` (id), ``weights``, ``tokens`` (routed to the group), ``aligned_on``
    (``activations``, ``weights`` or None), ``refit`` (done), ``refit_skipped`` (why not, or None), ``error_before``
    and ``error_after``: the group's relative output error ``‖Σ_j w_tj (f(x_t) - f_j(x_t))‖ / ‖Σ_j w_tj f_j(x_t)‖``
    (norms over all its routed tokens) of the averaged expert and of the expert returned (None for a group of one
    or without tokens).
    """
    _check_groups(groups, moe.num_experts)
    device = hidden.device
    work = moe_on(moe, device)
    ids, weights = _route_all(adapter, work, hidden, router_input, chunk_tokens, token_ids, sequence_lengths)
    counts = torch.bincount(ids.reshape(-1), minlength=work.router_columns)[: work.num_experts].cpu()
    merged, reports = [], []
    for members in groups:
        if len(members) == 1:
            merged.append(_original(moe, members[0]))
            reports.append(_single_report(moe, members[0], int(counts[members[0]])))
            continue
        tensors, report = _merge_group(adapter, work, members, counts, ids, weights, hidden, refit, chunk_tokens)
        merged.append({name: _like(value, getattr(moe, name)) for name, value in tensors.items()})
        reports.append(report)
    block = _assemble(moe, merged, [moe.expert_ids[report["anchor_position"]] for report in reports])
    if moe.token_table is not None:
        block = replace(block, token_table=merged_table(moe.token_table, moe.router_weight, groups))
    return block, [{key: value for key, value in report.items() if key != "anchor_position"} for report in reports]


def _check_groups(groups: list[list[int]], num_experts: int) -> None:
    seen = [position for group in groups for position in group]
    if not groups or any(not group for group in groups):
        raise ValueError("expert merging needs non-empty groups")
    if len(set(seen)) != len(seen) or not all(0 <= position < num_experts for position in seen):
        raise ValueError(f"expert groups {groups} repeat an expert or name one outside 0..{num_experts - 1}")


def _route_all(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    hidden: torch.Tensor,
    router_input: torch.Tensor | None,
    chunk_tokens: int,
    token_ids: torch.Tensor | None = None,
    sequence_lengths: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token's ``(ids, weights)``; with ``sequence_lengths`` (chunks then end at sequence ends) the tokens a
    sequence-level rule takes away get the id ``router_columns``, no expert's."""
    from .expert_scores import _chunks

    ids, weights = [], []
    for start, end, lengths in _chunks(hidden.shape[0], chunk_tokens, sequence_lengths):
        routed_by = hidden if router_input is None else router_input
        chunk = routed_by[start:end].to(hidden.device).float()
        chunk_tokens_ids = None if token_ids is None else token_ids[start:end]
        chunk_ids, chunk_weights = adapter.route(moe, adapter.router_logits(moe, chunk), token_ids=chunk_tokens_ids)
        if lengths is not None:
            chunk_weights = adapter.sequence_routing(moe, chunk_ids, chunk_weights, lengths)
            chunk_ids = chunk_ids.masked_fill(chunk_weights == 0, moe.router_columns)
        ids.append(chunk_ids)
        weights.append(chunk_weights.float())
    if not ids:
        raise ValueError("expert merging needs at least one calibration token")
    return torch.cat(ids), torch.cat(weights)


_EXPERT_TENSORS = MoEWeights.EXPERT_TENSORS
_ROUTER_TENSORS = MoEWeights.ROUTER_TENSORS


def _original(moe: MoEWeights, position: int) -> dict[str, torch.Tensor | None]:
    return {
        name: None if (t := getattr(moe, name)) is None else t[position] for name in _EXPERT_TENSORS + _ROUTER_TENSORS
    }


def _like(value: torch.Tensor | None, reference: torch.Tensor | None) -> torch.Tensor | None:
    return None if value is None else value.to(device=reference.device, dtype=reference.dtype)


def _single_report(moe: MoEWeights, position: int, tokens: int) -> dict[str, Any]:
    return {
        "members": [moe.expert_ids[position]],
        "anchor": moe.expert_ids[position],
        "anchor_position": position,
        "weights": [1.0],
        "tokens": tokens,
        "aligned_on": None,
        "refit": False,
        "refit_skipped": "single expert",
        "error_before": None,
        "error_after": None,
    }


def _assemble(moe: MoEWeights, merged: list[dict[str, torch.Tensor | None]], expert_ids: list[int]) -> MoEWeights:
    def stack(name: str) -> torch.Tensor | None:
        if getattr(moe, name) is None:
            return None
        return torch.stack([part[name] for part in merged]).contiguous()

    def router(name: str) -> torch.Tensor | None:
        full = getattr(moe, name)
        if full is None:
            return None
        return torch.cat([torch.stack([part[name] for part in merged]), full[moe.num_experts :]]).contiguous()

    return replace(
        moe,
        **{name: stack(name) for name in _EXPERT_TENSORS},
        router_weight=router("router_weight"),
        router_bias=router("router_bias"),
        correction_bias=router("correction_bias"),
        expert_scale=stack("expert_scale"),
        expert_ids=expert_ids,
    )


def _merge_group(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    members: list[int],
    counts: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    hidden: torch.Tensor,
    refit: bool,
    chunk_tokens: int,
) -> tuple[dict[str, torch.Tensor | None], dict[str, Any]]:
    inter = moe.intermediate_size
    member_counts = counts[members].double()
    anchor = members[max(range(len(members)), key=lambda i: (int(member_counts[i]), -i))]
    total = member_counts.sum()
    share = (member_counts / total if total > 0 else torch.full_like(member_counts, 1 / len(members))).float()
    routes = _GroupRoutes(adapter, members, ids, weights)
    aligned_on = "activations" if routes.tokens >= inter else "weights"
    if aligned_on == "activations":
        similarity = _activation_correlation(adapter, moe, members, anchor, routes, hidden, chunk_tokens)
    else:
        similarity = _weight_similarity(moe, members, anchor)
    matches = {
        m: torch.arange(inter, device=ids.device) if m == anchor else _greedy_match(similarity[m]) for m in members
    }
    tensors: dict[str, torch.Tensor | None] = {name: None for name in _EXPERT_TENSORS + _ROUTER_TENSORS}
    for name in _EXPERT_TENSORS:
        if getattr(moe, name) is not None:
            tensors[name] = sum(
                share[i] * _aligned(moe, name, member, matches[member]).float() for i, member in enumerate(members)
            )
    for name in _ROUTER_TENSORS:
        if getattr(moe, name) is not None:
            tensors[name] = sum(share[i] * getattr(moe, name)[member].float() for i, member in enumerate(members))
    report = {
        "members": [moe.expert_ids[m] for m in members],
        "anchor": moe.expert_ids[anchor],
        "anchor_position": anchor,
        "weights": [round(float(w), 6) for w in share],
        "tokens": routes.tokens,
        "aligned_on": aligned_on,
        "refit": False,
        "refit_skipped": None,
        "error_before": None,
        "error_after": None,
    }
    if routes.tokens == 0:
        report["refit_skipped"] = "no routed tokens"
        return tensors, report
    if moe.expert_norm is not None:
        report["refit_skipped"] = "each expert normalises its output, which the linear refit of down does not model"
        return tensors, report
    system = _normal_equations(adapter, moe, tensors, routes, hidden, chunk_tokens)
    averaged = _down_matrix(tensors)
    report["error_before"] = report["error_after"] = system.relative_error(averaged)
    if not refit:
        report["refit_skipped"] = "not asked"
    elif routes.tokens < inter:
        report["refit_skipped"] = f"{routes.tokens} routed tokens, fewer than its {inter} neurons"
    elif (solved := system.ridge_solution(inter)) is None:
        report["refit_skipped"] = "its intermediate activations are all zero"
    else:
        tensors["down"] = solved[:inter].T.contiguous()
        if tensors["down_bias"] is not None:
            tensors["down_bias"] = solved[inter].contiguous()
        report["refit"] = True
        report["error_after"] = system.relative_error(solved)
    return tensors, report


class _GroupRoutes:
    """The tokens routed to at least one member of a group, and which of their top-k slots are the group's."""

    def __init__(self, adapter: FamilyAdapter, members: list[int], ids: torch.Tensor, weights: torch.Tensor):
        rule = adapter.routing_rule()
        in_group = (ids[..., None] == torch.tensor(members, device=ids.device)).any(-1)
        self.rows = in_group.any(1).nonzero().squeeze(1)
        self.tokens = int(self.rows.numel())
        self.in_group = in_group[self.rows]
        self.ids = ids[self.rows]
        self.weights = weights[self.rows]
        self.output_weights = rule.output_weight(self.weights) * self.in_group
        self.rule = rule

    def chunks(self, hidden: torch.Tensor, chunk_tokens: int):
        """``(x, merged_input, part)`` per chunk: the tokens, what the merged expert computes on, and the chunk's
        slice of this object's per-token tensors."""
        for start in range(0, self.tokens, chunk_tokens):
            part = slice(start, start + chunk_tokens)
            x = hidden[self.rows[part]].float()
            merged_input = x
            if self.rule.scales_input:
                mask = self.in_group[part]
                mean_weight = (self.weights[part] * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)
                merged_input = self.rule.expert_input(x, mean_weight)
            yield x, merged_input, part


def _intermediate(adapter: FamilyAdapter, moe: MoEWeights, expert: int, x: torch.Tensor) -> torch.Tensor:
    bias = None if moe.gate_up_bias is None else moe.gate_up_bias[expert].float()
    return _intermediate_of(adapter, moe.gate_up[expert].float(), bias, x, moe.intermediate_size, moe.layer)


def _intermediate_of(
    adapter: FamilyAdapter,
    gate_up: torch.Tensor,
    bias: torch.Tensor | None,
    x: torch.Tensor,
    inter: int,
    layer: int | None,
) -> torch.Tensor:
    return adapter.expert_hidden(F.linear(x, gate_up, bias), inter, layer)


def _activation_correlation(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    members: list[int],
    anchor: int,
    routes: _GroupRoutes,
    hidden: torch.Tensor,
    chunk_tokens: int,
) -> dict[int, torch.Tensor]:
    """Per member but the anchor, ``[I, I]`` Pearson correlations of the anchor's neurons (rows) with its own
    (columns) on the group's routed tokens, each member computing on the merged expert's input."""
    inter = moe.intermediate_size
    zeros = torch.zeros(inter, dtype=torch.float64, device=hidden.device)
    others = [m for m in members if m != anchor]
    sums = {m: zeros.clone() for m in members}
    squares = {m: zeros.clone() for m in members}
    cross = {m: torch.zeros(inter, inter, dtype=torch.float64, device=hidden.device) for m in others}
    for _, merged_input, _ in routes.chunks(hidden, chunk_tokens):
        anchor_act = _intermediate(adapter, moe, anchor, merged_input).double()
        for member in members:
            act = anchor_act if member == anchor else _intermediate(adapter, moe, member, merged_input).double()
            sums[member] += act.sum(0)
            squares[member] += (act * act).sum(0)
            if member != anchor:
                cross[member] += anchor_act.T @ act
    n = routes.tokens
    std = {m: (squares[m] / n - (sums[m] / n) ** 2).clamp_min(0).sqrt() for m in members}
    correlation = {}
    for member in others:
        covariance = cross[member] / n - torch.outer(sums[anchor] / n, sums[member] / n)
        scale = torch.outer(std[anchor], std[member])
        correlation[member] = torch.where(scale > 0, covariance / scale.clamp_min(1e-300), 0.0)
    return correlation


def _neuron_features(moe: MoEWeights, expert: int) -> torch.Tensor:
    """``[I, F]``: each intermediate neuron's weights: gate and up rows, their biases, the down column."""
    inter = moe.intermediate_size
    rows = moe.gate_up[expert].float().reshape(-1, inter, moe.gate_up.shape[-1])  # [1 or 2, I, H]
    parts = [rows.permute(1, 0, 2).reshape(inter, -1), moe.down[expert].float().T]
    if moe.gate_up_bias is not None:
        parts.append(moe.gate_up_bias[expert].float().reshape(-1, inter).T)
    return torch.cat(parts, dim=1).double()


def _weight_similarity(moe: MoEWeights, members: list[int], anchor: int) -> dict[int, torch.Tensor]:
    anchor_features = F.normalize(_neuron_features(moe, anchor), dim=1)
    return {m: anchor_features @ F.normalize(_neuron_features(moe, m), dim=1).T for m in members if m != anchor}


def _greedy_match(similarity: torch.Tensor) -> torch.Tensor:
    """``[I]``: for each anchor neuron (row), the member neuron (column) matched to it by greedy matching: the most
    similar free pair first (ties: the first in row-major order), until all are matched.

    Computed in rounds: every free pair that is the best of its row and of its column among the free ones is one
    greedy would take (nothing it takes earlier can remove its row or column), so each round takes all of them."""
    count = similarity.shape[0]
    score = similarity.nan_to_num(nan=0.0)
    match = torch.full((count,), -1, dtype=torch.long, device=score.device)
    free_rows = torch.ones(count, dtype=torch.bool, device=score.device)
    free_cols = free_rows.clone()
    while free_rows.any():
        masked = score.masked_fill(~(free_rows[:, None] & free_cols[None, :]), float("-inf"))
        row_best, col_best = masked.argmax(1), masked.argmax(0)
        rows = free_rows.nonzero().squeeze(1)
        mutual = rows[col_best[row_best[rows]] == rows]
        match[mutual] = row_best[mutual]
        free_rows[mutual] = False
        free_cols[row_best[mutual]] = False
    return match


def _aligned(moe: MoEWeights, name: str, expert: int, match: torch.Tensor) -> torch.Tensor:
    """Expert ``expert``'s tensor ``name`` with its intermediate neurons in the order ``match``."""
    tensor = getattr(moe, name)[expert]
    match = match.to(tensor.device)
    if name == "down":
        return tensor[:, match]
    if name in ("down_bias", "expert_norm"):
        return tensor
    inter = moe.intermediate_size
    rows = match if not moe.gated else torch.cat([match, match + inter])
    return tensor[rows]


def _down_matrix(tensors: dict[str, torch.Tensor | None]) -> torch.Tensor:
    """``[I (+1), H]``: the down projection as the refit's unknowns (transposed, the bias as the last row)."""
    down = tensors["down"].T.double()
    bias = tensors["down_bias"]
    return down if bias is None else torch.cat([down, bias.double()[None]])


class _NormalEquations:
    """``G = Σ_t s_t² a_t a_tᵀ``, ``B = Σ_t s_t a_t y_tᵀ`` and ``C = Σ_t ‖y_t‖²`` (float64) for the group's output
    ``y_t = Σ_j w_tj f_j(x_t)``, its total weight ``s_t = Σ_j w_tj`` and the merged expert's intermediate activation
    ``a_t`` (with a trailing 1 where the down projection has a bias)."""

    def __init__(self, gram: torch.Tensor, cross: torch.Tensor, energy: torch.Tensor):
        self.gram, self.cross, self.energy = gram, cross, energy

    def relative_error(self, down: torch.Tensor) -> float | None:
        if self.energy <= 0:
            return None
        error = (down * (self.gram @ down)).sum() - 2 * (down * self.cross).sum() + self.energy
        return float((error.clamp_min(0) / self.energy).sqrt())

    def ridge_solution(self, inter: int) -> torch.Tensor | None:
        """The refitted down projection, or None where the merged expert's activations are all zero."""
        trace = torch.diagonal(self.gram)[:inter].sum()
        if trace <= 0:
            return None
        ridge = torch.zeros(self.gram.shape[0], dtype=self.gram.dtype, device=self.gram.device)
        ridge[:inter] = RIDGE * trace / inter
        return torch.linalg.solve(self.gram + torch.diag(ridge), self.cross)


def _normal_equations(
    adapter: FamilyAdapter,
    moe: MoEWeights,
    merged: dict[str, torch.Tensor | None],
    routes: _GroupRoutes,
    hidden: torch.Tensor,
    chunk_tokens: int,
) -> _NormalEquations:
    inter = moe.intermediate_size
    width = inter + (merged["down_bias"] is not None)
    device = hidden.device
    gram = torch.zeros(width, width, dtype=torch.float64, device=device)
    cross = torch.zeros(width, hidden.shape[1], dtype=torch.float64, device=device)
    energy = torch.zeros((), dtype=torch.float64, device=device)
    for x, merged_input, part in routes.chunks(hidden, chunk_tokens):
        activation = _intermediate_of(
            adapter, merged["gate_up"], merged["gate_up_bias"], merged_input, inter, moe.layer
        )
        if merged["down_bias"] is not None:
            activation = torch.cat([activation, torch.ones_like(activation[:, :1])], dim=1)
        output_weights = routes.output_weights[part]
        target = torch.zeros_like(x)
        for slot in range(output_weights.shape[1]):
            for expert in routes.ids[part][:, slot][routes.in_group[part][:, slot]].unique().tolist():
                rows = (routes.ids[part][:, slot] == expert).nonzero().squeeze(1)
                inputs = routes.rule.expert_input(x[rows], routes.weights[part][rows, slot, None])
                target[rows] += output_weights[rows, slot, None] * adapter.expert_output(moe, expert, inputs).float()
        weighted = activation.double() * output_weights.sum(1, keepdim=True).double()
        gram += weighted.T @ weighted
        cross += weighted.T @ target.double()
        energy += (target.double() ** 2).sum()
    return _NormalEquations(gram, cross, energy)
