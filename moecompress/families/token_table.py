"""Hash-routed layers' token-id tables (DeepSeek-V4's ``tid2eid``): which experts a table row names once some are
removed or merged.

A hash layer's router does not choose: row ``table[token id]`` names the token's ``k`` experts, and the router's
scores only weigh them. When an expert is removed, each row that names it names instead the kept expert closest to
it (Euclidean distance of their router rows, in float64 on the host; ties: the lower position) that the row does not
already name, so a token still gets ``k`` distinct experts. :func:`redirected` is that rule; the layer sweep's
rerouting, the view's routing (``allowed``), :meth:`MoEWeights.select` and the masked reference of
``scripts/family_sweep.py`` all apply it, so a pruned model computes what its input computes with the experts
masked. Merging sends a merged expert's entries to its group's expert (:func:`merged`).
"""

from __future__ import annotations

import torch


def redirected(rows: torch.Tensor, router_weight: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[N, k]`` (expert positions) with every entry that ``allowed`` (bool ``[E]``) excludes replaced by
    the closest allowed expert not already in its row, slot by slot from the first."""
    allowed = allowed.to(device="cpu", dtype=torch.bool)[: router_weight.shape[0]]
    out = rows.long().clone()
    if bool(allowed.all()):
        return out
    kept = allowed.nonzero().squeeze(1)
    if kept.numel() == 0:
        raise ValueError("a token-id table needs at least one kept expert")
    removed = (~allowed).nonzero().squeeze(1)
    weight = router_weight.detach().to(device="cpu", dtype=torch.float64)
    distance = torch.cdist(weight[removed], weight[kept], compute_mode="donot_use_mm_for_euclid_dist")
    nearest = torch.full((allowed.shape[0], kept.numel()), -1, dtype=torch.long)
    nearest[removed] = kept[distance.argsort(dim=1, stable=True)]
    nearest = nearest.to(out.device)
    allowed = allowed.to(out.device)
    candidates = min(out.shape[1], kept.numel())
    for slot in range(out.shape[1]):
        bad = (~allowed[out[:, slot]]).nonzero().squeeze(1)
        if bad.numel() == 0:
            continue
        ranked = nearest[out[bad, slot]]
        chosen = ranked[:, 0].clone()
        free = torch.zeros(bad.numel(), dtype=torch.bool, device=out.device)
        for rank in range(candidates):
            candidate = ranked[:, rank]
            take = ~free & ~(out[bad] == candidate[:, None]).any(dim=1)
            chosen[take] = candidate[take]
            free |= take
        out[bad, slot] = chosen
    return out


def renumbered(table: torch.Tensor, router_weight: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """The table of the block restricted to the experts at positions ``keep`` (in that order): removed experts'
    entries redirected (:func:`redirected`), then every position renumbered; in the table's dtype."""
    allowed = torch.zeros(router_weight.shape[0], dtype=torch.bool)
    allowed[keep] = True
    new_position = torch.full((router_weight.shape[0],), -1, dtype=torch.long)
    new_position[keep] = torch.arange(len(keep))
    return new_position[redirected(table, router_weight, allowed).cpu()].to(table.dtype)


def merged(table: torch.Tensor, router_weight: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
    """The table of the block whose group ``g`` of expert positions became its expert ``g``: every member's entries
    name its group (a row naming two members of one group names that expert twice, as the merged expert carries both
    routes); an expert in no group is removed (:func:`redirected` among the grouped ones)."""
    group_of = torch.full((router_weight.shape[0],), -1, dtype=torch.long)
    for index, members in enumerate(groups):
        group_of[members] = index
    entries = redirected(table, router_weight, group_of >= 0).cpu()
    return group_of[entries].to(table.dtype)


def table_route(
    table: torch.Tensor, router_weight: torch.Tensor, token_ids: torch.Tensor | None, allowed: torch.Tensor | None
) -> torch.Tensor:
    """The experts ``[T, k]`` a hash-routed block sends tokens ``token_ids`` ``[T]`` to, routed around the experts
    ``allowed`` excludes (None: all allowed)."""
    if token_ids is None:
        raise ValueError("a hash-routed block routes by token ids, and none were given")
    rows = table[token_ids.reshape(-1).to(table.device).long()].long()
    return rows if allowed is None else redirected(rows, router_weight, allowed)
