"""Router modes a family's tiny checkpoint does not exercise, checked against the stock router module."""

import pytest
import torch

from moecompress.families import adapter_for
from moecompress.synthetic import TINY_CONFIGS, tiny_config


@pytest.mark.parametrize(
    "overrides",
    [
        {"expert_selection_fn": "softmax"},
        {"expert_selection_fn": "sigmoid", "norm_topk_prob": True},
        {"expert_selection_fn": "sigmoid", "norm_topk_prob": False},
    ],
    ids=["softmax", "sigmoid-normalised", "sigmoid"],
)
def test_cohere2_moe_router_modes_match_the_stock_router(overrides):
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeTopKRouter

    config = tiny_config("cohere2_moe")
    for key, value in overrides.items():
        setattr(config, key, value)
    adapter = adapter_for(dict(TINY_CONFIGS["cohere2_moe"], **overrides))
    generator = torch.Generator().manual_seed(0)
    router = Cohere2MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
    hidden = torch.randn(64, config.hidden_size, generator=generator)
    with torch.no_grad():
        logits, stock_weights, stock_ids = router(hidden)
    ids, weights = adapter.routing_rule().route(logits)
    order_stock, order_ours = stock_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(stock_ids.gather(1, order_stock), ids.gather(1, order_ours))
    torch.testing.assert_close(stock_weights.gather(1, order_stock), weights.gather(1, order_ours))
