"""Inkling 2: the release's native names (block-residual queries outside the layers), the softcapped SwiGLU, and the
block stack (``block_states``) the layer sweep carries: the sweep's hidden states and logits, the Fisher pass's
gradients and a resumed sweep equal the stock model's."""

import pytest
import torch
from helpers import assert_view_computes_the_stock_layer, checkpoint_adapter, load_stock, text_sweep, token_batches
from synthetic import save_tiny_model

from moecompress.checkpoint import CheckpointReader
from moecompress.checkpoint.stream import group_keys_by_layer
from moecompress.quantization.sensitivity import block_output_fisher, next_token_loss
from moecompress.sweep.state import SweepState

FAMILIES = ("inkling2_text", "inkling2")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    return save_tiny_model(request.param, tmp_path_factory.mktemp(request.param) / "source")


def _stock(checkpoint, batches):
    """The stock model's last-layer outputs and logits per batch."""
    model = load_stock(checkpoint)
    last, logits = [], []
    layers = checkpoint_adapter(checkpoint).decoder_layers(model)
    handle = layers[-1].register_forward_hook(lambda module, args, out: last.append(out))
    with torch.no_grad():
        logits = [model(**batch).logits for batch in batches]
    handle.remove()
    return last, logits


def test_release_names_and_block_queries(checkpoint):
    adapter = checkpoint_adapter(checkpoint)
    with CheckpointReader(checkpoint) as reader:
        keys, outside = group_keys_by_layer(reader, adapter)
        assert "model.llm.attn_res.attn_queries.0" in keys[1] and "model.llm.attn_res.mlp_queries.0" in keys[0]
        assert "model.llm.attn_res.output_query" in outside
        moe, rest, layout = adapter.split_layer(1, reader.read(keys[1]))
        disk = reader.read(keys[1])
    assert adapter.moe_layers() == [0, 1, 2, 3] and [adapter.is_block_boundary(i) for i in range(4)] == [
        True,
        False,
        True,
        False,
    ]
    assert moe.router_bias is None and moe.correction_bias.shape == (8,)
    joined = adapter.join_layer(1, moe, rest, layout)
    assert set(joined) == set(disk) and all(torch.equal(joined[key], disk[key]) for key in disk)
    state = adapter.runtime_layer_state(1, moe, rest)
    stock = adapter.decoder_layers(load_stock(checkpoint))[1].state_dict()
    assert set(state) == set(stock) and all(torch.equal(state[key], stock[key]) for key in stock)


def test_routing_and_softcapped_activation_equal_the_stock_block(checkpoint):
    adapter = checkpoint_adapter(checkpoint)
    model = load_stock(checkpoint)
    with CheckpointReader(checkpoint) as reader:
        keys, _ = group_keys_by_layer(reader, adapter)
        moe, _, _ = adapter.split_layer(2, reader.read(keys[2]))
    hidden = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 4
    assert_view_computes_the_stock_layer(adapter, model, 2, moe, hidden)
    gate, up = torch.tensor([3.0]), torch.tensor([5.0])
    assert not torch.equal(adapter.activation(gate, up), torch.nn.functional.silu(gate) * up)


def test_sweep_carries_the_block_stack_to_every_layer_and_the_head(checkpoint):
    batches = token_batches()
    sweep = text_sweep(checkpoint, batches)
    last, logits = _stock(checkpoint, batches)
    for swept, stock in zip(sweep.last_hidden, last, strict=True):
        torch.testing.assert_close(swept, stock, rtol=1e-5, atol=1e-5)
    stacks = sweep.final_block_states(sweep.last_hidden)
    assert [tuple(stack.shape) for stack in stacks] == [(2, 24, 2, 64)] * 2
    held = sum(tensor.numel() * tensor.element_size() for tensor in sweep.carry.tensors().values())
    assert held == 2 * 96 * 64 * 4  # block boundaries x calibration tokens x hidden size x float32
    for head in (sweep.head_logits, sweep.text_head_logits):
        for swept, stock in zip(head(batches, sweep.last_hidden, stacks), logits, strict=True):
            torch.testing.assert_close(swept, stock, rtol=1e-5, atol=1e-5)
    without = next(sweep.head_logits(batches, sweep.last_hidden))
    assert (without - logits[0]).abs().max() > 0.1


def test_a_resumed_sweep_restores_the_block_stack(checkpoint, tmp_path):
    batches = token_batches()
    state = SweepState(tmp_path / "state")
    text_sweep(checkpoint, batches, state, stop_after=3)
    assert SweepState(tmp_path / "state").last_layer == 2
    assert {name.split("/")[0] for name in state.carried()} == {"blk"}
    resumed = text_sweep(checkpoint, batches, SweepState(tmp_path / "state"))
    last, _ = _stock(checkpoint, batches)
    for swept, stock in zip(resumed.last_hidden, last, strict=True):
        torch.testing.assert_close(swept, stock, rtol=1e-5, atol=1e-5)


def test_fisher_pass_follows_the_gradient_through_the_block_stack(checkpoint, tmp_path):
    batches = token_batches()
    adapter = checkpoint_adapter(checkpoint)
    model = load_stock(checkpoint)
    outputs = {}
    handles = [
        adapter.decoder_layers(model)[layer]
        .get_submodule(adapter.moe_site_module)
        .register_forward_hook(lambda module, args, out, layer=layer: outputs.setdefault(layer, []).append(out))
        for layer in adapter.moe_layers()
    ]
    expected = {layer: [] for layer in adapter.moe_layers()}
    for batch in batches:
        outputs.clear()
        loss = next_token_loss(model(**batch).logits, batch["input_ids"])
        blocks = {layer: values[0] for layer, values in outputs.items()}
        gradients = torch.autograd.grad(loss, list(blocks.values()))
        for layer, gradient in zip(blocks, gradients, strict=True):
            expected[layer].append(gradient.float().pow(2).mean(dim=-1).reshape(-1))
    for handle in handles:
        handle.remove()
    fisher = block_output_fisher(checkpoint, batches, tmp_path, progress=False)
    for layer, values in expected.items():
        torch.testing.assert_close(fisher[layer], torch.cat(values), rtol=1e-4, atol=1e-12)
