"""ERNIE 4.5 VL (``ernie4_5_vl_moe``): the view holds the text and vision expert sets (different widths), the vision
set is computed as stock transformers computes it, every prune method keeps equal counts in both sets (a pruned
output's vision set routes image tokens as the input's with the removed experts masked), the vision set is ranked
by its router's correction bias where no calibration token reaches it, and a quantised block is cut into the two
experts modules exactly."""

import json

import pytest
import torch
from helpers import layer_view, load_stock, run_cli
from synthetic import save_tiny_source

from moecompress.errors import UserInputError
from moecompress.families import adapter_for
from moecompress.passes.prune_experts import PruneExpertsConfig, prune_experts
from moecompress.quantization.scheme import QuantScheme
from moecompress.quantization.slicing import columns_of

FAMILY = "ernie4_5_vl_moe"
CALIB = dict(calib="builtin:prose", calib_tokens=256, seq_len=64, eval_tokens=None, progress=False)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    directory = save_tiny_source(FAMILY, tmp_path_factory.mktemp("ernie_vl") / FAMILY)
    return directory


def test_view_computes_the_vision_set_as_stock(source):
    adapter, moe = layer_view(source, 1)
    half = moe.num_experts // 2
    assert moe.num_experts == 8 and adapter.set_widths() == (64, 32)
    model = load_stock(source)
    vision = adapter.decoder_layers(model)[1].mlp.vision_moe
    hidden = torch.randn(30, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, stock_weights, stock_ids = vision.gate(hidden)
        stock_out = vision.experts(hidden, stock_ids, stock_weights)
        logits = adapter.router_logits(moe, hidden)[:, half:]
        ids, weights = adapter.routing_rule().route(logits, moe.correction_bias[half:])
        ours = adapter.combine_experts(
            hidden, ids, weights, lambda expert, x: adapter.expert_output(moe, half + expert, x)
        )
    assert torch.equal(ids, stock_ids)
    torch.testing.assert_close(ours, stock_out, rtol=1e-4, atol=1e-5)


def _masked_logits(model, adapter, source, removed, ids, token_types):
    """``model``'s logits for tokens ``ids`` of modalities ``token_types`` with each layer's ``removed`` experts
    masked out of routing: the text set's as the calibration sweep masks them, the vision set's by its rule."""
    handles = []
    for layer, gone in removed.items():
        _, moe = layer_view(source, layer)
        half = moe.num_experts // 2
        allowed = torch.ones(moe.num_experts, dtype=torch.bool)
        allowed[gone] = False

        def choose(logits, moe=moe, allowed=allowed):
            return adapter.route(moe, logits, allowed)

        def reroute(router, inputs, output, bias=moe.correction_bias[half:], allowed=allowed[half:]):
            ids, weights = adapter.routing_rule().route(output[0], bias, allowed)
            return output[0], weights.to(output[1].dtype), ids

        module = adapter.decoder_layers(model)[layer]
        handles += adapter.reroute_hooks(module, choose)
        handles.append(module.mlp.vision_moe.gate.register_forward_hook(reroute))
    with torch.no_grad():
        out = model(input_ids=ids, moe_mm_token_type_ids=token_types).logits
    for handle in handles:
        handle.remove()
    return out


@pytest.mark.parametrize("method", ["maep", "frequency", "merge"])
def test_every_method_keeps_equal_counts_and_the_vision_set_loads_in_stock(method, source, tmp_path):
    report = prune_experts(source, tmp_path / "out", PruneExpertsConfig(method=method, ratio=0.5), **CALIB)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["text_config"]["moe_num_experts"] == 2
    removed = {int(layer): entry["removed"] for layer, entry in report["layers"].items()}
    for entry in report["layers"].values():
        assert sum(e < 4 for e in entry["kept"]) == sum(e >= 4 for e in entry["kept"]) == 2
    adapter = adapter_for(json.loads((source / "config.json").read_text()))
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    token_types = torch.zeros_like(ids)
    token_types[:, 4:12] = 1  # image tokens: routed within the vision set
    pruned = _masked_logits(load_stock(tmp_path / "out"), adapter, source, {}, ids, token_types)
    if method == "merge":
        assert torch.isfinite(pruned).all()  # merged experts are new weights: no masked input equals them
        return
    reference = _masked_logits(load_stock(source), adapter, source, removed, ids, token_types)
    torch.testing.assert_close(pruned, reference, rtol=0, atol=1e-5)


def test_vision_set_without_calibration_tokens_is_ranked_by_its_correction_bias(source, tmp_path):
    report = prune_experts(source, tmp_path / "out", PruneExpertsConfig(method="frequency", ratio=0.5), **CALIB)
    for layer, entry in report["layers"].items():
        _, moe = layer_view(source, int(layer))
        bias = moe.correction_bias[4:]
        assert entry["frequency"][4:] == [0.0] * 4
        lowest = sorted(range(4), key=lambda e: (float(bias[e]), e))[:2]
        assert [e for e in entry["kept"] if e >= 4] == sorted(4 + e for e in lowest)


def test_global_scope_is_refused_in_one_line(source, tmp_path):
    result = run_cli("prune", str(source), "--out", str(tmp_path / "out"), "--scope", "global")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "from one moe_num_experts, so each layer keeps the same count: --scope global" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "options,message",
    [
        (["--scheme", "int4", "--group-size", "64"], "64/32 wide; the narrower is cut from the wider at a group"),
        (["--scheme", "mxfp4", "--salient-fraction", "0.01"], "leave --salient-fraction at 0"),
    ],
)
def test_schemes_the_sets_cannot_be_cut_in_are_refused_before_work(options, message, source, tmp_path):
    result = run_cli("quantize", str(source), "--out", str(tmp_path / "out"), *options)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_quantised_sets_are_the_sets_quantised_alone(source):
    from moecompress.quantization.experts import quantize_experts_rtn

    adapter, moe = layer_view(source, 1)
    scheme = QuantScheme.from_dict({"name": "mxfp4"})
    text, vision = adapter.quantized_expert_sets(quantize_experts_rtn(moe, scheme))
    for which, part in enumerate((text, vision)):
        gate_up, down = adapter.set_experts(moe, which)
        assert part.gate_up.shape == tuple(gate_up.shape) and part.down.shape == tuple(down.shape)
        assert torch.equal(part.gate_up.dequantize(), scheme.quantize(gate_up).dequantize())
        assert torch.equal(part.down.dequantize(), scheme.quantize(down).dequantize())
    with pytest.raises(UserInputError, match="does not end on a group of 32 input columns"):
        columns_of(scheme.quantize(moe.down), slice(0, 8), 16)


def test_qat_writes_the_trained_adapters_under_the_stored_names(source, tmp_path):
    """The student holds the text model as ``model.language_model.layers``, the checkpoint as ``model.layers``."""
    result = run_cli(
        "qat", str(source), "--out", str(tmp_path / "qat"), "--scheme", "int2", "--steps", "2", "--batch-size", "2",
        "--train-tokens", "256", "--calib-tokens", "256", "--seq-len", "64", "--eval-tokens", "128",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    model = load_stock(tmp_path / "qat")
    mlp = model.model.language_model.layers[1].mlp
    assert {type(mlp.text_moe.experts).__name__, type(mlp.vision_moe.experts).__name__} == {"QuantizedExperts"}
