"""Grouping routed (token, slot) pairs by expert for the fused MoE kernels, without a host sync.

Pair ``p = token · k + slot`` is routed to ``ids.view(-1)[p]``. Pairs are sorted by expert and each expert's
list is padded to a whole number of ``block`` rows, so every row block of the kernels belongs to one expert.
The number of blocks depends on the routing, so the layout is sized for the worst case,
``ceil(P / block) + E`` blocks, and blocks past the last expert's are marked ``-1`` (their programs exit at once);
that keeps the whole step on the device and capturable in a CUDA graph. Ids outside ``[0, E)`` route nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PairBlocks:
    """``pairs`` ``[blocks · block]`` int32: the pair index in each row slot, ``P`` (one past the last pair) in
    padding; ``experts`` ``[blocks]`` int32: each block's expert, ``-1`` for blocks past the end."""

    pairs: torch.Tensor
    experts: torch.Tensor
    block: int
    num_pairs: int


def group_pairs(ids: torch.Tensor, num_experts: int, block: int) -> PairBlocks:
    flat = ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, torch.full_like(flat, num_experts))
    counts = torch.bincount(bucket, minlength=num_experts + 1)
    blocks_per_expert = (counts[:num_experts] + block - 1) // block
    block_end = torch.cumsum(blocks_per_expert, 0)
    block_start = torch.cat([block_end.new_zeros(1), block_end])  # entry E: start of the trash bucket
    max_blocks = -(-num_pairs // block) + num_experts
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    first_in_sorted = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=device) - first_in_sorted[sorted_bucket]
    trash = max_blocks * block
    slot = torch.where(sorted_bucket < num_experts, block_start[sorted_bucket] * block + rank, trash)
    pairs = torch.full((trash + 1,), num_pairs, dtype=torch.int32, device=device)
    pairs[slot] = order.to(torch.int32)
    blocks = torch.arange(max_blocks, device=device)
    experts = torch.searchsorted(block_end, blocks, right=True)
    experts = torch.where(experts < num_experts, experts, torch.full_like(experts, -1)).to(torch.int32)
    return PairBlocks(pairs[:trash], experts, block, num_pairs)
