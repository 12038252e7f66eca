"""The layer-wise sweep reproduces what each MoE block sees inside the stock model's own forward."""

import pytest
import torch
import transformers

from moecompress.checkpoint import CheckpointReader
from moecompress.families import adapter_for
from moecompress.sweep import CalibrationSweep
from moecompress.synthetic import FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_sweep_matches_stock_forward(family, tiny_checkpoints):
    source = tiny_checkpoints[family]
    config = CheckpointReader(source).config
    adapter = adapter_for(config)
    model = getattr(transformers, adapter.auto_class).from_pretrained(source, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 300, (2, 24), generator=generator)} for _ in range(2)]

    expected = {}
    handles = []
    for layer in adapter.moe_layers():
        block = adapter.decoder_layers(model)[layer].get_submodule(adapter.router_module.rsplit(".", 1)[0])
        handles.append(block.register_forward_hook(
            lambda mod, args, out, layer=layer: expected.setdefault(layer, []).append(args[0].reshape(-1, args[0].shape[-1]))
        ))
    with torch.no_grad():
        for batch in batches:
            model(**batch, use_cache=False)
    for handle in handles:
        handle.remove()

    tags = torch.zeros(2 * 2 * 24, dtype=torch.long)
    sweep = CalibrationSweep(source, batches, tags, ["text"], capture_attention=True, progress=False)
    captures = list(sweep.run())
    assert [c.layer for c in captures] == adapter.moe_layers()
    for capture in captures:
        torch.testing.assert_close(capture.moe_input, torch.cat(expected[capture.layer]), rtol=1e-5, atol=1e-5)
        assert capture.attention_received.shape == (96,)
        assert torch.all(capture.attention_received > 0)
        assert capture.moe.num_experts == adapter.num_experts
