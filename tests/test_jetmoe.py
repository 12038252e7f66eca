"""JetMoE: the MLP experts' grouped router output read and written exactly, the attention's experts (MoA) left as
read, the plugin's experts module in the block, and the one-line refusal of expert pruning."""

import json

import torch
from helpers import run_cli

from moecompress.families import adapter_for
from moecompress.families.jetmoe import JetMoeRoutedBlock
from moecompress.synthetic import build_tiny_model

E, H = 8, 64


def _layer_view(model, layer=0):
    adapter = adapter_for(model.config.to_dict())
    prefix = adapter.layer_prefix(layer)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith(prefix)}
    moe, rest, layout = adapter.split_layer(layer, tensors)
    return adapter, moe, rest, layout, tensors


def _tokens(count=48):
    return torch.randn(1, count, H, generator=torch.Generator().manual_seed(1))


def test_the_mlp_experts_are_the_view_and_the_attention_experts_stay_as_read():
    adapter, moe, rest, layout, tensors = _layer_view(build_tiny_model("jetmoe"))
    assert torch.equal(moe.gate_up, tensors["model.layers.0.mlp.input_linear.weight"])
    assert torch.equal(moe.down, tensors["model.layers.0.mlp.output_linear.weight"])
    assert {"model.layers.0.mlp.bias", "model.layers.0.self_attention.experts.input_linear.weight"} <= rest.keys()
    joined = adapter.join_layer(0, moe, rest, layout)
    assert joined.keys() == tensors.keys() and all(torch.equal(joined[k], tensors[k]) for k in tensors)
    assert adapter.classify_key("model.layers.0.self_attention.experts.router.layer.weight") == "attention"
    assert adapter.classify_key("model.layers.0.mlp.router.layer.weight") == "router"
    assert adapter.classify_key("model.layers.0.mlp.output_linear.weight") == "experts"
    assert adapter.head_counts() == (4, 2, 16)


def test_the_grouped_route_is_read_and_written_exactly():
    model = build_tiny_model("jetmoe")
    adapter, moe, _, _, _ = _layer_view(model)
    block = model.model.layers[0].mlp
    hidden = _tokens()[0]
    with torch.no_grad():
        output = block.router(hidden)
        logits, weights, ids = adapter.route_of(output)
        top, want_ids = logits.topk(2, dim=1)
        assert torch.equal(ids, want_ids) and torch.equal(weights, torch.softmax(top, dim=1))
        rewritten = adapter.with_route(output, weights, ids)
        assert [torch.equal(a, b) for a, b in zip(rewritten[1:3], output[1:3], strict=True)] == [True, True]
        assert rewritten[3] == output[3]
        allowed = torch.ones(E, dtype=torch.bool)
        allowed[[0, 5]] = False
        handles = adapter.reroute_hooks(model.model.layers[0], lambda lg: adapter.route(moe, lg, allowed))
        rerouted = block(hidden[None])[0] - block.bias
        for handle in handles:
            handle.remove()
        free = block(hidden[None])[0] - block.bias
        view = adapter.moe_forward(moe, hidden, allowed)
    torch.testing.assert_close(rerouted, view, rtol=0, atol=1e-6)
    assert (rerouted - free).abs().max() > 1e-3


def test_the_plugins_block_computes_what_the_stock_block_does():
    model = build_tiny_model("jetmoe")
    adapter = adapter_for(model.config.to_dict())
    ids = torch.randint(3, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock = model(input_ids=ids).logits
        adapter.with_experts_module(model)
        assert all(isinstance(layer.mlp, JetMoeRoutedBlock) for layer in model.model.layers)
        routed = model(input_ids=ids).logits
    torch.testing.assert_close(routed, stock, rtol=0, atol=1e-5)


def test_removing_experts_is_one_line_exit_2_before_work(tiny_checkpoints, tmp_path):
    source = tiny_checkpoints["jetmoe"]
    for method in ("maep", "merge"):
        out = tmp_path / method
        result = run_cli("prune", str(source), "--out", str(out), "--keep", "4", "--method", method)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "attention (MoA) and MLP experts share one count, num_local_experts" in result.stderr
        assert not out.exists()
    config = json.loads((source / "config.json").read_text())
    assert adapter_for(config).num_experts == E
