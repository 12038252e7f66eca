"""The sweeps ask the kernel to read the next layer ahead (CheckpointReader.advise): every stored byte of the keys
named, in pieces, and nothing else."""

import os

import pytest
import torch

from moecompress.checkpoint import CheckpointReader
from moecompress.checkpoint import reader as reader_module
from moecompress.device import is_accelerated
from moecompress.sweep.engine import CalibrationSweep

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform")


def _advised(monkeypatch) -> list[tuple[int, int]]:
    calls = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: calls.append((offset, length)))
    monkeypatch.setattr(reader_module, "ADVICE_CHUNK", 4096)
    return calls


def test_advice_covers_the_stored_bytes_of_the_keys_in_pieces(tiny_checkpoints, monkeypatch):
    reader = CheckpointReader(tiny_checkpoints["qwen3_moe"])
    calls = _advised(monkeypatch)
    keys = [key for key in reader.keys() if ".layers.1." in key]
    reader._advise(keys)
    covered = set()
    for offset, length in calls:
        assert 0 < length <= 4096
        covered.update(range(offset, offset + length))
    wanted = set()
    for key in keys:
        info = reader.tensors[key]
        wanted.update(range(info.offset, info.offset + info.nbytes))
    assert covered == wanted


def test_merged_ranges_join_touching_and_overlapping_spans():
    assert reader_module._merged([(10, 20), (0, 5), (5, 8), (15, 30), (40, 41)]) == [(0, 8), (10, 30), (40, 41)]


@pytest.mark.skipif(is_accelerated(), reason="on an accelerator the next layer is read on a thread instead")
def test_a_sweep_advises_each_next_layer_as_it_computes_one(tiny_checkpoints, monkeypatch):
    source = tiny_checkpoints["qwen3_moe"]
    advised = []
    monkeypatch.setattr(CheckpointReader, "advise", lambda self, keys: advised.append(sorted(keys)))
    batches = [{"input_ids": torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(0))}]
    sweep = CalibrationSweep(source, batches, torch.zeros(8, dtype=torch.long), ["text"], progress=False)
    for _ in sweep.run():
        pass
    layers = sweep.adapter.num_layers
    assert advised == [sorted(sweep.layer_keys[layer]) for layer in range(1, layers)]
