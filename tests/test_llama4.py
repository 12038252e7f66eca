"""Llama 4 scales each token by its routing weight before the expert: what the experts compute on (GPTQ's inputs),
rerouting around removed experts in the sweep, and per-layer expert counts in the plugin all follow stock
transformers' Llama4TextMoe."""

import copy
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from helpers import layer_view, load_stock, plain_perplexity, rewrite_checkpoint
from synthetic import tiny_tokenizer

from moecompress.checkpoint import CheckpointReader
from moecompress.cli.main import app
from moecompress.families import adapter_for
from moecompress.quantization.experts import routed_inputs
from moecompress.sweep.engine import CalibrationSweep

KEEP = [0, 2, 3, 5, 6, 7]


def test_routed_inputs_are_the_scaled_tokens_the_stock_experts_receive(tiny_checkpoints):
    source = tiny_checkpoints["llama4"]
    model = load_stock(source)
    layer = adapter_for(CheckpointReader(source).config).moe_layers()[-1]
    adapter, moe = layer_view(source, layer)
    hidden = torch.randn(50, moe.router_weight.shape[1], generator=torch.Generator().manual_seed(0))
    received = []
    handle = adapter.experts_of(model, layer).register_forward_hook(lambda m, args, out: received.append(args[0]))
    with torch.no_grad():
        adapter.moe_block_of(model, layer)(hidden)
    handle.remove()
    per_expert = received[0].reshape(moe.num_experts, 50, -1)
    inputs = routed_inputs(adapter, moe, hidden)
    for expert, x in enumerate(inputs):
        rows = per_expert[expert].any(dim=-1)
        torch.testing.assert_close(x, per_expert[expert][rows])
        assert not torch.allclose(x, hidden[rows]), "the expert's input is the scaled token"
    assert sum(x.shape[0] for x in inputs) == 50 * adapter.top_k


def _without_experts(adapter, model, layer, keep):
    """Replace layer ``layer``'s stock MoE block by a stock block holding only the experts ``keep``."""
    block = adapter.moe_block_of(model, layer)
    config = copy.copy(model.config.text_config)
    config.num_local_experts = len(keep)
    small = type(block)(config)
    state = block.state_dict()
    for name in ("router.weight", "experts.gate_up_proj", "experts.down_proj"):
        state[name] = state[name][keep]
    small.load_state_dict(state)
    setattr(adapter.decoder_layers(model)[layer], adapter.moe_block_name, small.eval())


def _moe_inputs(adapter, model, layer, batch):
    seen = []
    handle = adapter.moe_block_of(model, layer).register_forward_hook(
        lambda m, args, out: seen.append(args[0].reshape(-1, args[0].shape[-1]))
    )
    with torch.no_grad():
        model(**batch, use_cache=False)
    handle.remove()
    return seen[0]


def test_the_sweep_reroutes_around_removed_experts_as_the_stock_model_without_them(tiny_checkpoints):
    source = tiny_checkpoints["llama4"]
    adapter = adapter_for(CheckpointReader(source).config)
    first, second = adapter.moe_layers()[:2]
    batch = {"input_ids": torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))}
    model = load_stock(source)
    unpruned = _moe_inputs(adapter, model, second, batch)
    _without_experts(adapter, model, first, KEEP)
    expected = _moe_inputs(adapter, model, second, batch)
    assert not torch.allclose(expected, unpruned, atol=1e-3), "removing the experts must change the next layer"

    allowed = torch.zeros(adapter.num_experts, dtype=torch.bool)
    allowed[KEEP] = True
    sweep = CalibrationSweep(source, [batch], torch.zeros(48, dtype=torch.long), ["text"], progress=False)
    for capture in sweep.run():
        if capture.layer == first:
            capture.replacement, capture.allowed = capture.moe, allowed
        elif capture.layer == second:
            torch.testing.assert_close(capture.moe_input, expected, rtol=1e-5, atol=1e-5)


def test_global_prune_with_per_layer_counts_loads_through_the_plugin(tiny_checkpoints, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(tiny_checkpoints["llama4"], source)
    tiny_tokenizer().save_pretrained(source)
    out = tmp_path / "pruned"
    options = ["--calib-tokens", "512", "--seq-len", "64", "--eval-tokens", "512"]
    result = CliRunner().invoke(
        app, ["prune", str(source), "--out", str(out), *options, "--ratio", "0.375", "--scope", "global"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "moecompress_report.json").read_text())
    adapter = adapter_for(json.loads((out / "config.json").read_text()))
    counts = {layer: adapter.experts_in_layer(layer) for layer in adapter.moe_layers()}
    assert len(set(counts.values())) > 1, f"the seeded run keeps different counts per layer, not {counts}"
    perplexity, model = plain_perplexity(out, 64, 512)
    for layer, count in counts.items():
        assert adapter.experts_of(model, layer).gate_up_proj.shape[0] == count
        assert adapter.router_of(model, layer).weight.shape[0] == count
    assert perplexity == pytest.approx(report["eval"]["perplexity"], rel=1e-4)


def test_experts_stored_per_expert_read_as_the_fused_release_and_round_trip(tiny_checkpoints, tmp_path):
    """vLLM's Llama 4 loader also takes ``feed_forward.experts.{e}.{gate,up,down}_proj.weight``: the same view, and
    the layout written back as found."""
    from safetensors.torch import load_file, save_file

    source = tiny_checkpoints["llama4"]
    per_expert = tmp_path / "per_expert"
    shutil.copytree(source, per_expert)
    tensors = load_file(per_expert / "model.safetensors")
    for key in [k for k in tensors if k.endswith("feed_forward.experts.gate_up_proj")]:
        prefix = key[: -len("gate_up_proj")]
        gate_up, down = tensors.pop(key), tensors.pop(prefix + "down_proj")
        inter = down.shape[1]
        for expert in range(gate_up.shape[0]):
            tensors[f"{prefix}{expert}.gate_proj.weight"] = gate_up[expert, :, :inter].T.contiguous()
            tensors[f"{prefix}{expert}.up_proj.weight"] = gate_up[expert, :, inter:].T.contiguous()
            tensors[f"{prefix}{expert}.down_proj.weight"] = down[expert].T.contiguous()
    save_file(tensors, str(per_expert / "model.safetensors"), metadata={"format": "pt"})

    layer = adapter_for(CheckpointReader(source).config).moe_layers()[-1]
    fused, split = layer_view(source, layer)[1], layer_view(per_expert, layer)[1]
    assert torch.equal(fused.gate_up, split.gate_up) and torch.equal(fused.down, split.down)
    out = rewrite_checkpoint(per_expert, tmp_path / "out")
    with CheckpointReader(per_expert) as before, CheckpointReader(out) as after:
        assert set(before.keys()) == set(after.keys())
        assert all(torch.equal(before.tensor(k), after.tensor(k)) for k in before.keys())
