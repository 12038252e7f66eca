"""Mixed precision to a byte budget: one GGML type per tensor, the sum of the measured errors as small as the budget
allows.

Each tensor offers options (type, bytes, error). Options that cost more without erring less are dropped; along the
rest (the lower convex hull of error against bytes) each step up buys error reduction at a price per byte. Steps are
bought greedily, the cheapest error per byte first, while they fit: for a separable sum of convex costs this is the
Lagrangian optimum at the budget's multiplier. What is left is then spent on any single upgrade that still fits
(best error per byte first), so less than the smallest remaining step is left unspent.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    type_name: str
    nbytes: int
    error: float


def _useful(options: list[Option]) -> list[Option]:
    """The options on the lower convex hull of error against bytes, cheapest first."""
    ordered = sorted(options, key=lambda o: (o.nbytes, o.error))
    frontier: list[Option] = []
    for option in ordered:
        if frontier and option.error >= frontier[-1].error:
            continue
        if frontier and option.nbytes == frontier[-1].nbytes:
            frontier[-1] = option
            continue
        frontier.append(option)
    hull: list[Option] = []
    for option in frontier:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or above the segment a -> option: buying option straight from a is no dearer per byte
            if (b.error - a.error) * (option.nbytes - a.nbytes) >= (option.error - a.error) * (b.nbytes - a.nbytes):
                hull.pop()
            else:
                break
        hull.append(option)
    return hull


def smallest(options: dict[str, list[Option]]) -> int:
    return sum(min(o.nbytes for o in choices) for choices in options.values())


def allocate(options: dict[str, list[Option]], budget: int) -> dict[str, Option]:
    """The option per tensor that minimises the summed error with the summed bytes at most ``budget``. The caller
    checks ``budget >= smallest(options)``."""
    hulls = {name: _useful(choices) for name, choices in options.items()}
    chosen = {name: hull[0] for name, hull in hulls.items()}
    spent = sum(option.nbytes for option in chosen.values())
    if spent > budget:
        raise ValueError(f"the smallest types take {spent} bytes, more than the budget of {budget}")

    def step(name: str, position: int) -> tuple[float, int, str, int] | None:
        hull = hulls[name]
        if position + 1 >= len(hull):
            return None
        here, there = hull[position], hull[position + 1]
        gain = (here.error - there.error) / (there.nbytes - here.nbytes)
        return (-gain, there.nbytes - here.nbytes, name, position + 1)

    heap = [entry for name in hulls if (entry := step(name, 0)) is not None]
    heapq.heapify(heap)
    positions = dict.fromkeys(hulls, 0)
    while heap:
        _, cost, name, position = heapq.heappop(heap)
        if spent + cost > budget:
            continue
        spent += cost
        positions[name] = position
        chosen[name] = hulls[name][position]
        following = step(name, position)
        if following is not None:
            heapq.heappush(heap, following)
    while True:
        best = None
        for name, choices in options.items():
            current = chosen[name]
            for option in choices:
                extra = option.nbytes - current.nbytes
                if extra <= 0 or spent + extra > budget or option.error >= current.error:
                    continue
                gain = (current.error - option.error) / extra
                if best is None or gain > best[0]:
                    best = (gain, name, option)
        if best is None:
            return chosen
        _, name, option = best
        spent += option.nbytes - chosen[name].nbytes
        chosen[name] = option
