"""Single-pass ΔH equals brute force; masked routing equals routing in a model without the expert."""

import pytest
import torch
from helpers import assert_delta_h_with_removed_experts

from moecompress.checkpoint import CheckpointReader
from moecompress.families import adapter_for
from moecompress.passes.expert_scores import brute_force_delta_h, layer_expert_stats


def _layer_view(checkpoint):
    with CheckpointReader(checkpoint) as reader:
        adapter = adapter_for(reader.config)
        layer = adapter.moe_layers()[0]
        prefix = adapter.layer_prefix(layer)
        moe, _, _ = adapter.split_layer(layer, reader.read(k for k in reader.keys() if k.startswith(prefix)))
    return adapter, moe


@pytest.mark.parametrize(
    "family", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "deepseek_v2", "gpt_oss", "llama4"]
)
def test_single_pass_delta_h_matches_brute_force(family, tiny_checkpoints):
    adapter, moe = _layer_view(tiny_checkpoints[family])
    hidden = torch.randn(300, moe.router_weight.shape[1], generator=torch.Generator().manual_seed(0))
    stats = layer_expert_stats(adapter, moe, hidden, chunk_tokens=128)
    expected = brute_force_delta_h(adapter, moe, hidden)
    torch.testing.assert_close(stats.delta_h, expected, rtol=1e-5, atol=1e-5)
    assert stats.delta_h.max() > 0.1
    k = adapter.top_k
    assert stats.frequency.sum().item() == pytest.approx(k)
    ids, _ = adapter.routing_rule().route(adapter.router_logits(moe, hidden), moe.correction_bias)
    # Unnormalised softmax (qwen2_moe here) rescales every token; group-limited rules can switch groups.
    if family in ("qwen3_moe", "mixtral", "gpt_oss", "llama4"):
        routed = torch.zeros(300, moe.num_experts, dtype=torch.bool).scatter_(1, ids, True)
        assert torch.all(stats.delta_h[~routed] == 0), "only tokens that chose e change when e is removed"


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "gpt_oss", "llama4"])
def test_masked_route_equals_route_without_the_expert(family, tiny_checkpoints):
    adapter, moe = _layer_view(tiny_checkpoints[family])
    hidden = torch.randn(200, moe.router_weight.shape[1], generator=torch.Generator().manual_seed(1))
    rule = adapter.routing_rule()
    removed = 2
    keep = [e for e in range(moe.num_experts) if e != removed]
    allowed = torch.ones(moe.num_experts, dtype=torch.bool)
    allowed[removed] = False
    ids, weights = rule.route(adapter.router_logits(moe, hidden), allowed=allowed)
    pruned = moe.select(keep)
    pruned_ids, pruned_weights = rule.route(adapter.router_logits(pruned, hidden))
    mapped = torch.tensor(keep)[pruned_ids]
    torch.testing.assert_close(ids.sort(-1).values, mapped.sort(-1).values)
    torch.testing.assert_close(weights.gather(1, ids.argsort(-1)), pruned_weights.gather(1, mapped.argsort(-1)))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "llama4"])
def test_delta_h_with_experts_already_removed_matches_brute_force(family, tiny_checkpoints):
    """The greedy order re-scores survivors against the reduced block; check that ΔH too."""
    adapter, moe = _layer_view(tiny_checkpoints[family])
    hidden = torch.randn(200, moe.router_weight.shape[1], generator=torch.Generator().manual_seed(2))
    removed = torch.zeros(moe.num_experts, dtype=torch.bool)
    removed[[1, 6]] = True
    assert_delta_h_with_removed_experts(adapter, moe, hidden, removed, ~removed)


def test_greedy_order_removes_down_to_top_k():
    from test_prune import _vision_capture

    from moecompress.passes.prune_experts import PruneExpertsConfig, choose_removals, score_layer

    adapter, capture = _vision_capture()
    config = PruneExpertsConfig(method="maep", ratio=0.5, prune_tags=("vision",), greedy=True, greedy_step=1)
    scores = score_layer(adapter, capture, config)
    assert len(scores.removal_order) == 2 and len(set(scores.removal_order)) == 2
    assert choose_removals([scores], config, top_k=2) == {0: sorted(scores.removal_order)}
    assert sorted(scores.removal_order) == [0, 1]
