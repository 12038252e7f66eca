"""Families whose sparse-attention layers reuse what an earlier layer computed: the previous layer's indexer top-k
(GLM-5, GLM-5.3-Flash, HY-V4: ``"shared"`` layers), Kolibri 1.1's index pool and shared keys and values. With indexer
budgets smaller than the sequence, the layer sweep's outputs equal the stock forward's, and without the carry a
reusing layer fails."""

from __future__ import annotations

import json

import pytest
from helpers import assert_sweep_equals_the_stock_forward, text_sweep, token_batches
from synthetic import save_tiny_model

from moecompress.sweep.layer_carry import LayerCarry

SMALL_BUDGETS = {
    "glm_moe_dsa": {"index_topk": 8},
    "glm5_next": {"index_topk": 8},
    "hy_v4": {"index_topk": 8},
    "hy_v4_vl": {"index_topk": 8},
    "kolibri1_1": {"index_topk": 4, "index_pool_size": 8},
}
"""Per family, the budgets that make the tiny model's selection matter on 24 tokens."""


@pytest.fixture(scope="module", params=sorted(SMALL_BUDGETS))
def checkpoint(request, tmp_path_factory):
    directory = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param) / "source")
    config = json.loads((directory / "config.json").read_text())
    text = config.get("text_config", config)
    assert "shared" in text.get("indexer_types", []) or "reuse" in _kolibri_modes(text)
    text.update(SMALL_BUDGETS[request.param])
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _kolibri_modes(text) -> list[str]:
    sources = text.get("kv_source_layers") or []
    return ["reuse" if source != layer else "own" for layer, source in enumerate(sources)]


def test_sweep_outputs_equal_the_stock_forward(checkpoint):
    assert_sweep_equals_the_stock_forward(checkpoint)


def test_without_the_carry_a_shared_layer_has_no_top_k(checkpoint, monkeypatch):
    monkeypatch.setattr(LayerCarry, "arguments", lambda self, layer, batch, kwargs: kwargs)
    with pytest.raises((ValueError, KeyError, TypeError)):
        text_sweep(checkpoint, token_batches()[:1])
