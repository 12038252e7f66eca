"""The layer sweep carries what a decoder layer hands to later ones (Mistral Large 4's indexer top-k and shared
latent KV): its layer-by-layer outputs equal the stock forward's, also when a killed sweep resumes."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import load_stock
from synthetic import save_tiny_model

from moecompress.sweep.engine import CalibrationSweep
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


def _batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(3, 380, (2, 24), generator=generator)} for _ in range(2)]


def _stock_last_hidden(checkpoint, batches) -> list[torch.Tensor]:
    model = load_stock(checkpoint)
    layers = model.model.language_model.layers
    outputs = []
    handle = layers[-1].register_forward_hook(lambda module, args, out: outputs.append(out[0]))
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    handle.remove()
    return outputs


def _sweep(checkpoint, batches, state=None, stop_after=None) -> CalibrationSweep:
    tokens = sum(batch["input_ids"].numel() for batch in batches)
    sweep = CalibrationSweep(checkpoint, batches, torch.zeros(tokens, dtype=torch.long), ["text"], progress=False)
    for capture in sweep.run(state):
        if capture.layer == stop_after:
            return sweep
    return sweep


def test_the_tiny_config_shares_top_k_and_kv(checkpoint):
    sweep = _sweep(checkpoint, _batches()[:1], stop_after=1)
    text = sweep._config.text_config
    assert "shared" in text.indexer_types and text.kv_source_layers != list(range(text.num_hidden_layers))


def test_sweep_outputs_equal_the_stock_forward(checkpoint):
    batches = _batches()
    sweep = _sweep(checkpoint, batches)
    for swept, stock in zip(sweep.last_hidden, _stock_last_hidden(checkpoint, batches), strict=True):
        torch.testing.assert_close(swept, stock, rtol=0, atol=1e-5)


def test_without_the_carry_a_shared_layer_has_no_top_k(checkpoint, monkeypatch):
    monkeypatch.setattr(LayerCarry, "arguments", lambda self, layer, batch, kwargs: kwargs)
    with pytest.raises((ValueError, KeyError)):
        _sweep(checkpoint, _batches()[:1])


def test_a_resumed_sweep_gets_the_carried_state_back(checkpoint, tmp_path):
    batches = _batches()
    state = SweepState(tmp_path / "state")
    _sweep(checkpoint, batches, state, stop_after=3)
    assert state.last_layer == 2 and state.carried()
    resumed = _sweep(checkpoint, batches, SweepState(tmp_path / "state"))
    for swept, stock in zip(resumed.last_hidden, _stock_last_hidden(checkpoint, batches), strict=True):
        torch.testing.assert_close(swept, stock, rtol=0, atol=1e-5)
