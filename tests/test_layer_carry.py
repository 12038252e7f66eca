"""The layer sweep carries what a decoder layer hands to later ones (Mistral Large 4's indexer top-k and shared
latent KV): its layer-by-layer outputs equal the stock forward's, also when a killed sweep resumes."""

from __future__ import annotations

import json

import pytest
from helpers import assert_sweep_equals_the_stock_forward, text_sweep, token_batches
from synthetic import save_tiny_model

from moecompress.sweep.layer_carry import LayerCarry
from moecompress.sweep.state import SweepState

FAMILY = "mistral_large4"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model with an indexer top-k of 8 of the 24 tokens, so that the carried top-k decides the outputs."""
    directory = save_tiny_model(FAMILY, tmp_path_factory.mktemp("ml4") / "source")
    config = json.loads((directory / "config.json").read_text())
    config["text_config"]["index_topk"] = 8
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_the_tiny_config_shares_top_k_and_kv(checkpoint):
    sweep = text_sweep(checkpoint, token_batches()[:1], stop_after=1)
    text = sweep._config.text_config
    assert "shared" in text.indexer_types and text.kv_source_layers != list(range(text.num_hidden_layers))


def test_sweep_outputs_equal_the_stock_forward(checkpoint):
    assert_sweep_equals_the_stock_forward(checkpoint)


def test_without_the_carry_a_shared_layer_has_no_top_k(checkpoint, monkeypatch):
    monkeypatch.setattr(LayerCarry, "arguments", lambda self, layer, batch, kwargs: kwargs)
    with pytest.raises((ValueError, KeyError)):
        text_sweep(checkpoint, token_batches()[:1])


def test_a_resumed_sweep_gets_the_carried_state_back(checkpoint, tmp_path):
    batches = token_batches()
    state = SweepState(tmp_path / "state")
    text_sweep(checkpoint, batches, state, stop_after=3)
    assert state.last_layer == 2 and state.carried()
    assert_sweep_equals_the_stock_forward(checkpoint, SweepState(tmp_path / "state"))
