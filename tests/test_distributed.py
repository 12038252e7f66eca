"""Calibration sharded over torch.distributed ranks gives what one process gives."""

import pytest
import torch

from moecompress.calibration import distributed
from moecompress.errors import UserInputError


def _batches(sizes):
    start, out = 0, []
    for rows in sizes:
        out.append({"input_ids": torch.arange(start, start + rows * 4).reshape(rows, 4)})
        start += rows * 4
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_get_contiguous_whole_batches_with_their_tags(world, monkeypatch):
    batches = _batches([2, 2, 1, 2, 2])
    tags = torch.arange(36) % 5
    monkeypatch.setattr(distributed, "world_size", lambda: world)
    ids, shard_tags = [], []
    for rank in range(world):
        monkeypatch.setattr(distributed, "rank", lambda rank=rank: rank)
        shard = distributed.shard_calibration(batches, tags)
        assert shard.batches, "every rank gets at least one batch"
        assert all(any(b is s for b in batches) for s in shard.batches), "batches are handed out whole"
        ids += [b["input_ids"].reshape(-1) for b in shard.batches]
        shard_tags.append(shard.tags)
    assert torch.equal(torch.cat(ids), torch.arange(36))
    assert torch.equal(torch.cat(shard_tags), tags)


def test_fewer_batches_than_ranks_is_an_error(monkeypatch):
    monkeypatch.setattr(distributed, "world_size", lambda: 3)
    with pytest.raises(UserInputError, match="cannot be shared by 3 ranks"):
        distributed.shard_calibration(_batches([2, 2]), torch.zeros(16, dtype=torch.long))


def test_outside_a_job_reductions_are_the_identity_in_float64():
    a, b = torch.tensor([1.5, 2.0], dtype=torch.float32), torch.ones(2, 3)
    total_a, total_b = distributed.sum_over_ranks(a, b)
    assert total_a.dtype == torch.float64 and torch.equal(total_a, a.double()) and torch.equal(total_b, b.double())
    values, sizes = distributed.gather_in_rank_order(torch.arange(5.0))
    assert torch.equal(values, torch.arange(5.0)) and sizes == [5]
    assert distributed.is_writer() and distributed.world_size() == 1
