"""Nemotron-H: non-gated experts in the view, the quantised module and the release config's layer pattern."""

from __future__ import annotations

import json
from dataclasses import replace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from moecompress.families import adapter_for
from moecompress.quantization.experts import quantize_experts_rtn
from moecompress.quantization.modules import QuantizedExperts
from moecompress.quantization.scheme import QuantScheme
from moecompress.synthetic import build_tiny_model, save_tiny_model


def test_release_pattern_gives_the_layer_kinds():
    adapter = adapter_for({"model_type": "nemotron_h", "n_routed_experts": 8, "hybrid_override_pattern": "ME*-E"})
    assert adapter.num_layers == 5
    assert adapter.moe_layers() == [1, 4]
    assert [adapter.softmax_attention(i) for i in range(5)] == [False, False, True, False, False]


def test_view_holds_up_rows_and_writes_the_same_bytes(tmp_path):
    directory = save_tiny_model("nemotron_h", tmp_path / "model")
    tensors = load_file(directory / "model.safetensors")
    adapter = adapter_for(json.loads((directory / "config.json").read_text()))
    prefix = "backbone.layers.1."
    layer = {key: value for key, value in tensors.items() if key.startswith(prefix)}
    moe, rest, layout = adapter.split_layer(1, dict(layer))
    assert layout == "per_expert" and not moe.gated
    assert tuple(moe.gate_up.shape) == (8, 32, 64) and tuple(moe.down.shape) == (8, 64, 32)
    assert not any(".experts." in key for key in rest)
    written = adapter.join_layer(1, moe, rest, layout)
    assert written.keys() == layer.keys()
    assert all(torch.equal(written[key], layer[key]) for key in layer)


def test_expert_output_equals_the_stock_experts():
    model = build_tiny_model("nemotron_h")
    adapter = adapter_for(model.config.to_dict())
    experts = model.model.layers[1].mixer.experts
    moe = adapter.split_layer(
        1,
        {f"backbone.layers.1.{k}": v for k, v in model.model.layers[1].state_dict().items() if "experts." not in k}
        | {
            f"backbone.layers.1.mixer.experts.{e}.{name}.weight": getattr(experts, name)[e].detach()
            for e in range(8)
            for name in ("up_proj", "down_proj")
        },
    )[0]
    hidden = torch.randn(12, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, 8, (12, 2), generator=torch.Generator().manual_seed(1))
    weights = torch.rand(12, 2, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        stock = experts(hidden, ids, weights)
        ours = adapter.combine_experts(hidden, ids, weights, lambda e, x: adapter.expert_output(moe, e, x))
    torch.testing.assert_close(ours, stock, rtol=1e-6, atol=1e-6)
    assert torch.equal(
        adapter.expert_output(moe, 3, hidden), F.linear(F.relu(F.linear(hidden, moe.gate_up[3])) ** 2, moe.down[3])
    )


def test_quantised_module_has_up_proj_and_computes_the_dequantised_expert(tmp_path):
    directory = save_tiny_model("nemotron_h", tmp_path / "model")
    adapter = adapter_for(json.loads((directory / "config.json").read_text()))
    tensors = load_file(directory / "model.safetensors")
    moe = adapter.split_layer(1, {k: v for k, v in tensors.items() if k.startswith("backbone.layers.1.")})[0]
    quantized = quantize_experts_rtn(moe, QuantScheme("mxfp4"))
    ranks = {"up": [2] + [0] * 7, "down": [0] * 8}
    module = QuantizedExperts(8, 64, 32, QuantScheme("mxfp4"), adapter.activation, ranks=ranks, gated=False)
    names = {name for name, _ in module.named_parameters()}
    assert {"up_proj", "up_proj_scales", "down_proj", "lowrank.0.up_L"} <= names and "gate_up_proj" not in names
    generator = torch.Generator().manual_seed(0)
    left, right = torch.randn(32, 2, generator=generator), torch.randn(2, 64, generator=generator)
    state = {**quantized.gate_up.stored("up_proj"), **quantized.down.stored("down_proj")}
    state.update({"lowrank.0.up_L": left, "lowrank.0.up_R": right})
    module.load_state_dict({k: v.to(module.state_dict()[k].dtype) for k, v in state.items()})
    dequantized = quantized.dequantized()
    up = dequantized.gate_up.clone()
    up[0] += left.bfloat16().float() @ right.bfloat16().float()
    reference = replace(dequantized, gate_up=up)
    hidden = torch.randn(10, 64, generator=generator)
    ids = torch.randint(0, 8, (10, 2), generator=generator)
    weights = torch.rand(10, 2, generator=generator)
    with torch.no_grad():
        ours = module(hidden, ids, weights)
    expected = adapter.combine_experts(hidden, ids, weights, lambda e, x: adapter.expert_output(reference, e, x))
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
