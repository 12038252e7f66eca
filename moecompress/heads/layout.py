"""Which heads a prunable unit is: a KV group (one KV head and the query heads that read it) or one query head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

Unit = Literal["kv-group", "query-head"]
UNITS: tuple[str, ...] = get_args(Unit)


@dataclass(frozen=True)
class HeadLayout:
    """One layer's attention shape and the unit gates act on.

    transformers' ``repeat_kv`` gives KV head ``j`` the query heads ``j * group_size ... (j + 1) * group_size - 1``.
    """

    heads: int
    kv_heads: int
    head_dim: int
    unit: Unit

    @property
    def group_size(self) -> int:
        return self.heads // self.kv_heads

    @property
    def units(self) -> int:
        return self.kv_heads if self.unit == "kv-group" else self.heads

    def query_mask(self, units: torch.Tensor) -> torch.Tensor:
        """Per-query-head gate ``[..., heads]`` from per-unit gates ``[..., units]``."""
        return units.repeat_interleave(self.group_size, dim=-1) if self.unit == "kv-group" else units

    def kv_mask(self, units: torch.Tensor) -> torch.Tensor:
        """Per-KV-head gate ``[..., kv_heads]``; query-head units never close a KV head."""
        if self.unit == "kv-group":
            return units
        return torch.ones(*units.shape[:-1], self.kv_heads, dtype=units.dtype, device=units.device)

    def kept_heads(self, keep_units: list[int]) -> tuple[list[int], list[int]]:
        """(query heads, KV heads) that survive when ``keep_units`` are kept, both ascending."""
        keep = sorted(keep_units)
        if self.unit == "kv-group":
            queries = [g * self.group_size + i for g in keep for i in range(self.group_size)]
            return queries, keep
        return keep, list(range(self.kv_heads))

    def unit_group(self, unit: int) -> int:
        """The KV group a unit belongs to."""
        return unit if self.unit == "kv-group" else unit // self.group_size

    def rows(self, heads: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
        """Projection rows (or o_proj columns) of ``heads``, on ``device``."""
        first = torch.tensor(heads, dtype=torch.long, device=device)[:, None] * self.head_dim
        return (first + torch.arange(self.head_dim, device=device)).reshape(-1)
