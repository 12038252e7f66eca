"""DeepSeek-V4: the release's names, sqrt-softplus routing, the clamped SwiGLU, hash layers outside the expert view."""

import json

import pytest
import torch
from helpers import load_stock

from moecompress.checkpoint import CheckpointReader
from moecompress.checkpoint.stream import group_keys_by_layer
from moecompress.errors import UserInputError
from moecompress.families import adapter_for
from moecompress.synthetic import TINY_CONFIGS, tiny_config


def _adapter(directory):
    return adapter_for(json.loads((directory / "config.json").read_text()))


def test_hash_layers_are_outside_the_view_and_the_release_count_is_read():
    adapter = adapter_for(tiny_config("deepseek_v4").to_dict())
    assert adapter.moe_layers() == [1, 2]
    legacy = {k: v for k, v in TINY_CONFIGS["deepseek_v4"].items() if k != "mlp_layer_types"}
    assert adapter_for({**legacy, "num_hidden_layers": 4, "num_hash_layers": 2}).moe_layers() == [2, 3]


def test_the_release_layout_loads_in_stock_transformers_with_its_int32_table(tiny_checkpoints):
    directory = tiny_checkpoints["deepseek_v4"]
    with CheckpointReader(directory) as reader:
        keys = set(reader.keys())
        assert {"embed.weight", "head.weight", "hc_head_fn", "layers.1.ffn.gate.bias"} <= keys
        assert reader.read(["layers.0.ffn.gate.tid2eid"])["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    model = load_stock(directory)
    table = model.model.layers[0].mlp.gate.tid2eid
    assert len({tuple(row) for row in table.tolist()}) > 1 and (table < 8).all()


def test_routing_and_activation_equal_the_stock_router_and_experts(tiny_checkpoints):
    directory = tiny_checkpoints["deepseek_v4"]
    adapter = _adapter(directory)
    model = load_stock(directory)
    with CheckpointReader(directory) as reader:
        keys, _ = group_keys_by_layer(reader, adapter)
        moe, _, _ = adapter.split_layer(1, reader.read(keys[1]))
    hidden = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    _, weights, ids = adapter.stock_route(model, 1, hidden)
    view_ids, view_weights = adapter.routing_rule().route(adapter.router_logits(moe, hidden), moe.correction_bias)
    assert torch.equal(view_ids, ids) and torch.equal(view_weights, weights)
    stock = adapter.stock_experts(model, 1, hidden, ids, weights)
    view = adapter.combine_experts(hidden, ids, weights, lambda expert, x: adapter.expert_output(moe, expert, x))
    torch.testing.assert_close(view, stock, rtol=0, atol=1e-6)
    clamped = adapter.activation(torch.full((1,), 20.0), torch.full((1,), -20.0))
    assert torch.equal(clamped, torch.nn.functional.silu(torch.full((1,), 10.0)) * -10.0)


def test_expert_pruning_is_refused_in_one_line_naming_the_hash_layers(tiny_checkpoints, tmp_path):
    from moecompress import api

    with pytest.raises(UserInputError, match=r"layers \[0\] pick experts from a token-id table") as info:
        api.prune(tiny_checkpoints["deepseek_v4"], tmp_path / "out", keep=4, evaluation=None)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_mxfp4_quantises_the_routed_layers_and_leaves_the_hash_layer_as_it_was(tiny_checkpoints, tmp_path):
    import moecompress  # noqa: F401 - the plugin
    from moecompress import api

    source, out = tiny_checkpoints["deepseek_v4"], tmp_path / "mxfp4"
    api.quantize(source, out, scheme="mxfp4", evaluation=None)
    adapter = _adapter(out)
    model = load_stock(out)
    hashed, original = model.model.layers[0].mlp.state_dict(), load_stock(source).model.layers[0].mlp.state_dict()
    assert hashed.keys() == original.keys() and all(torch.equal(hashed[k], original[k]) for k in original)
    assert {type(adapter.experts_of(model, layer)).__name__ for layer in (1, 2)} == {"QuantizedExperts"}
    assert type(adapter.experts_of(model, 0)).__name__ == "DeepseekV4Experts"
    ids = torch.randint(3, 384, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
