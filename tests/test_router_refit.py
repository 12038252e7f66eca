"""Router recalibration: the refit lowers a pruned layer's output error on its calibration tokens, never raises it,
keeps shapes, dtypes and the fixed routing tensors, and gives the same bytes on every call."""

import pytest
import torch

from moecompress.checkpoint import CheckpointReader
from moecompress.families import adapter_for
from moecompress.passes.router_refit import recalibrate_router

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "llama4")
FAST = dict(steps=60, batch_tokens=256, eval_every=20, lr=3e-3)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The fits here are thousands of tiny ops: with 2 threads on a loaded 2-core machine their barriers cost 20x the
    arithmetic (the bytes are the same with 1 and 2 threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def layers(tiny_checkpoints):
    """The first MoE layer's view of each family's tiny random checkpoint, with its adapter."""
    out = {}
    for family in FAMILIES:
        with CheckpointReader(tiny_checkpoints[family]) as reader:
            adapter = adapter_for(reader.config)
            layer = adapter.moe_layers()[0]
            prefix = adapter.layer_prefix(layer)
            moe, _, _ = adapter.split_layer(layer, reader.read(k for k in reader.keys() if k.startswith(prefix)))
        out[family] = adapter, moe
    return out


def _tokens(moe, count=512, seed=0):
    return torch.randn(count, moe.router_weight.shape[1], generator=torch.Generator().manual_seed(seed))


def _kept(moe, fraction, groups=1):
    """The experts left after removing ``fraction`` of them, the same number from each of ``groups`` routing groups
    (DeepSeek-V3's group-limited rule needs equal groups)."""
    size = moe.num_experts // groups
    drop = round(size * fraction)
    return [g * size + e for g in range(groups) for e in range(size) if e % size >= drop]


def _error(adapter, reference, compressed, hidden):
    with torch.no_grad():
        ref = adapter.moe_forward(reference, hidden)
        out = adapter.moe_forward(compressed, hidden)
    return float((out - ref).double().pow(2).sum() / ref.double().pow(2).sum())


@pytest.mark.parametrize("fraction", [0.25, 0.5])
@pytest.mark.parametrize("family", FAMILIES)
def test_refit_reduces_the_pruned_layers_error(family, fraction, layers):
    adapter, moe = layers[family]
    hidden = _tokens(moe)
    pruned = moe.select(_kept(moe, fraction, adapter.routing_rule().n_group))
    refit, report = recalibrate_router(adapter, moe, pruned, hidden, **FAST)
    before, after = _error(adapter, moe, pruned, hidden), _error(adapter, moe, refit, hidden)
    assert report["error_before"] == pytest.approx(before, rel=1e-9)
    assert report["error_after"] == pytest.approx(after, rel=1e-9)
    assert after < before * 0.999, report["history"]
    assert report["best_step"] > 0 and report["tokens"] == 512 and report["steps"] == FAST["steps"]
    assert refit.router_weight.shape == pruned.router_weight.shape
    assert refit.router_weight.dtype == pruned.router_weight.dtype
    assert not torch.equal(refit.router_weight, pruned.router_weight)
    if pruned.router_bias is not None:
        assert refit.router_bias.shape == pruned.router_bias.shape
        assert refit.router_bias.dtype == pruned.router_bias.dtype
    for name in ("gate_up", "down", "correction_bias", "expert_scale", "gate_up_bias", "down_bias"):
        assert getattr(refit, name) is getattr(pruned, name)
    assert refit.expert_ids == pruned.expert_ids


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_two_calls_give_the_same_bytes(family, layers):
    adapter, moe = layers[family]
    hidden = _tokens(moe, seed=1)
    pruned = moe.select(_kept(moe, 0.5))
    first, first_report = recalibrate_router(adapter, moe, pruned, hidden, **FAST)
    second, second_report = recalibrate_router(adapter, moe, pruned, hidden, **FAST)
    assert first_report == second_report
    assert first.router_weight.numpy().tobytes() == second.router_weight.numpy().tobytes()
    if first.router_bias is not None:
        assert first.router_bias.numpy().tobytes() == second.router_bias.numpy().tobytes()
    other, _ = recalibrate_router(adapter, moe, pruned, hidden, **FAST, seed=1)
    assert not torch.equal(other.router_weight, first.router_weight), "the seed orders the minibatches"


def test_nothing_removed_returns_the_block_itself(layers):
    adapter, moe = layers["gpt_oss"]
    refit, report = recalibrate_router(adapter, moe, moe, _tokens(moe), **FAST)
    assert report["error_before"] == 0.0 and report["error_after"] == 0.0 and report["best_step"] == 0
    assert torch.equal(refit.router_weight, moe.router_weight) and torch.equal(refit.router_bias, moe.router_bias)
    pruned = moe.select(_kept(moe, 0.5))
    unchanged, report = recalibrate_router(adapter, moe, pruned, _tokens(moe), steps=0)
    assert unchanged is pruned and report["history"] == [[0, report["error_before"]]]


def test_steps_that_only_hurt_leave_the_rows_untouched(layers):
    adapter, moe = layers["qwen3_moe"]
    hidden = _tokens(moe)
    pruned = moe.select(_kept(moe, 0.25))
    refit, report = recalibrate_router(adapter, moe, pruned, hidden, steps=40, lr=50.0, batch_tokens=128, eval_every=10)
    assert all(error > report["error_before"] for _, error in report["history"][1:]), report["history"]
    assert report["best_step"] == 0 and report["error_after"] == report["error_before"]
    assert refit.router_weight.numpy().tobytes() == pruned.router_weight.numpy().tobytes()


def test_a_bf16_router_is_fitted_and_stored_in_bf16(layers):
    """The best rows are chosen by their error once cast back to the router's dtype."""
    adapter, moe = layers["qwen3_moe"]
    moe = moe.select(list(range(moe.num_experts)))
    moe.router_weight = moe.router_weight.to(torch.bfloat16)
    hidden = _tokens(moe)
    pruned = moe.select(_kept(moe, 0.5))
    refit, report = recalibrate_router(adapter, moe, pruned, hidden, **FAST)
    assert refit.router_weight.dtype == torch.bfloat16
    assert report["error_after"] == pytest.approx(_error(adapter, moe, refit, hidden), rel=1e-9)
    assert report["error_after"] < report["error_before"]


def test_the_router_reads_its_own_input(layers):
    """Where the family's router reads another input than the experts, the fit uses it."""
    adapter, moe = layers["qwen3_moe"]
    hidden, router_input = _tokens(moe), _tokens(moe, seed=5)
    pruned = moe.select(_kept(moe, 0.5))
    refit, report = recalibrate_router(adapter, moe, pruned, hidden, router_input, **FAST)

    def error(block):
        ref = adapter.moe_forward(moe, hidden, router_input=router_input)
        out = adapter.moe_forward(block, hidden, router_input=router_input)
        return float((out - ref).double().pow(2).sum() / ref.double().pow(2).sum())

    assert report["error_before"] == pytest.approx(error(pruned), rel=1e-9)
    assert report["error_after"] == pytest.approx(error(refit), rel=1e-9) and error(refit) < error(pruned)


def test_bad_arguments_are_refused(layers):
    adapter, moe = layers["qwen3_moe"]
    hidden = _tokens(moe)
    with pytest.raises(ValueError, match="router_input holds 3 tokens"):
        recalibrate_router(adapter, moe, moe, hidden, hidden[:3])
    with pytest.raises(ValueError, match="at least one calibration token"):
        recalibrate_router(adapter, moe, moe, hidden[:0])
    with pytest.raises(ValueError, match="lr > 0"):
        recalibrate_router(adapter, moe, moe, hidden, lr=0.0)
