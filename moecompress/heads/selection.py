"""Which units to keep: per-layer counts from a ratio, baseline scores (weight magnitude, random), and the choice
of the lowest-scored units, uniform within KV groups for query-head units."""

from __future__ import annotations

import torch

from ..errors import OptionError
from ..vocabulary import named
from .layout import HeadLayout


def magnitude_scores(tensors: dict[str, torch.Tensor], layout: HeadLayout) -> torch.Tensor:
    """Per unit, the Frobenius norm of all its weights: its query heads' q rows and o_proj columns, and for a KV
    group its k and v rows."""
    d = layout.head_dim
    q = tensors["q_proj.weight"].float().reshape(layout.heads, d, -1).pow(2).sum((1, 2))
    o = tensors["o_proj.weight"].float().reshape(-1, layout.heads, d).pow(2).sum((0, 2))
    per_query = q + o
    if layout.unit == "query-head":
        return per_query.sqrt()
    k = tensors["k_proj.weight"].float().reshape(layout.kv_heads, d, -1).pow(2).sum((1, 2))
    v = tensors["v_proj.weight"].float().reshape(layout.kv_heads, d, -1).pow(2).sum((1, 2))
    return (per_query.reshape(layout.kv_heads, layout.group_size).sum(1) + k + v).sqrt()


def random_scores(layout: HeadLayout, seed: int, layer: int) -> torch.Tensor:
    return torch.rand(layout.units, generator=torch.Generator().manual_seed(seed * 100_003 + layer), device="cpu")


def removal_counts(layouts: list[HeadLayout], ratio: float) -> list[int]:
    """Units to remove from each layer for ``--scope layer``; a :class:`UserInputError` for counts that remove
    nothing, everything, or (query heads) do not split evenly over the KV groups."""
    counts = []
    for layer, layout in enumerate(layouts):
        count = round(ratio * layout.units)
        what = "KV groups" if layout.unit == "kv-group" else "query heads"
        if count == 0:
            raise OptionError(f"layer {layer}: {named('ratio', ratio)} of {layout.units} {what} removes none")
        if count >= layout.units:
            raise OptionError(f"layer {layer}: {named('ratio', ratio)} removes every one of its {layout.units} {what}")
        if layout.unit == "query-head":
            if count % layout.kv_heads:
                raise OptionError(
                    f"layer {layer}: {count} query heads do not split evenly over {layout.kv_heads} KV groups "
                    f"(query heads stay uniform within groups; pick another {named('ratio')})"
                )
        counts.append(count)
    return counts


def global_removal_counts(layouts: list[HeadLayout], ratio: float, scores: list[torch.Tensor]) -> list[int]:
    """Per-layer removals for ``--scope global``: the lowest scores over all layers (each layer's scores divided
    by their mean absolute value first, so magnitudes of different layers compare), at least one unit left
    per layer."""
    total = sum(layout.units for layout in layouts)
    remove = round(ratio * total)
    if remove == 0:
        raise OptionError(f"{named('ratio', ratio)} of {total} KV groups removes none")
    if remove > total - len(layouts):
        raise OptionError(f"{named('ratio', ratio)} would remove every KV group of some layer")
    ranked = sorted(
        (float(s[u]) / max(float(s.abs().mean()), 1e-12), layer, u)
        for layer, s in enumerate(scores)
        for u in range(s.numel())
    )
    counts = [0] * len(layouts)
    for _, layer, _ in ranked:
        if sum(counts) == remove:
            break
        if layouts[layer].units - counts[layer] > 1:
            counts[layer] += 1
    return counts


def choose_keep(scores: torch.Tensor, layout: HeadLayout, remove: int) -> list[int]:
    """The units kept when the ``remove`` lowest-scored are removed (ties: higher index first), ascending; for
    query-head units the same number goes from every KV group."""
    if layout.unit == "kv-group":
        order = sorted(range(layout.units), key=lambda u: (float(scores[u]), -u))
        return sorted(order[remove:])
    per_group = remove // layout.kv_heads
    keep = []
    for group in range(layout.kv_heads):
        members = range(group * layout.group_size, (group + 1) * layout.group_size)
        keep += sorted(members, key=lambda u: (float(scores[u]), -u))[per_group:]
    return sorted(keep)
