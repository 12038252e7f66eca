"""Streamed evaluation (one decoder layer at a time) gives the whole-model evaluation's figures."""

import pytest
import torch
from synthetic import FAMILIES, SENTINELS, save_tiny_source

from moecompress.calibration.batches import TokenWindows
from moecompress.calibration.span_corruption import corrupt_spans
from moecompress.checkpoint import CheckpointReader, resolve_model
from moecompress.evals import streamed
from moecompress.evals.perplexity import evaluate, evaluate_windows
from moecompress.families import adapter_for
from moecompress.loading import load_model
from moecompress.passes.prune_experts import PruneExpertsConfig, prune_experts
from moecompress.passes.prune_heads import PruneHeadsConfig, prune_heads
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint

FIGURES = ("perplexity", "kl", "routing_agreement", "reference_perplexity")
SMALL = dict(calib_tokens=1024, seq_len=64, progress=False)


def assert_same_figures(got, want):
    assert (got.tokens, got.windows, got.seq_len) == (want.tokens, want.windows, want.seq_len)
    for name in FIGURES:
        value, expected = getattr(got, name), getattr(want, name)
        if expected is None:
            assert value is None, name
        else:
            assert value == pytest.approx(expected, rel=1e-4, abs=1e-7), name


def _compare_files(model_dir, reference_dir=None, seq_len=32, max_tokens=384):
    kwargs = dict(seq_len=seq_len, max_tokens=max_tokens, reference_dir=reference_dir, progress=False)
    got = evaluate(model_dir, "builtin:prose", **kwargs)
    want = evaluate(model_dir, "builtin:prose", **kwargs, whole_model=True)
    assert_same_figures(got, want)
    return got


@pytest.fixture(scope="module")
def tiny_moe():
    return resolve_model("builtin:tiny-moe")


@pytest.fixture(scope="module")
def tiny_outputs(tiny_moe, tmp_path_factory):
    root = tmp_path_factory.mktemp("streamed")
    outputs = {
        "layer": prune_experts(tiny_moe, root / "layer", PruneExpertsConfig(ratio=0.25), **SMALL),
        "global": prune_experts(tiny_moe, root / "global", PruneExpertsConfig(ratio=0.4, scope="global"), **SMALL),
        "mxfp4": quantize_checkpoint(tiny_moe, root / "mxfp4", QuantizeConfig(scheme="mxfp4"), **SMALL),
        "int2": quantize_checkpoint(
            tiny_moe,
            root / "int2",
            QuantizeConfig(scheme="int2", lowrank_budget=0.375, targets=("experts", "attention")),
            **SMALL,
        ),
    }
    assert outputs
    return {name: root / name for name in outputs}


def test_original_against_itself(tiny_moe):
    result = _compare_files(tiny_moe, tiny_moe)
    assert result.kl == 0.0 and result.routing_agreement == 1.0
    assert result.perplexity == result.reference_perplexity


def test_original_without_reference(tiny_moe):
    result = _compare_files(tiny_moe)
    assert result.kl is None and result.routing_agreement is None


@pytest.mark.parametrize("name", ["layer", "global", "mxfp4", "int2"])
def test_compressed_outputs_against_the_original(name, tiny_moe, tiny_outputs):
    out = tiny_outputs[name]
    with CheckpointReader(out) as reader:
        config = reader.config
    if name == "global":
        assert config["moecompress"].get("experts_per_layer"), "global scope should leave uneven expert counts"
    if name in ("mxfp4", "int2"):
        assert config["quantization_config"]["quant_method"] == "moecompress"
        assert streamed.whole_model_reason(out) is None
    result = _compare_files(out, tiny_moe)
    assert result.kl > 0.0 and 0.0 < result.routing_agreement < 1.0


def test_head_pruned_output_with_per_layer_head_counts(tmp_path):
    source = save_tiny_source("olmoe", tmp_path / "olmoe")
    config = PruneHeadsConfig(ratio=0.5, method="magnitude", distill_steps=0, batch_size=4)
    prune_heads(source, tmp_path / "heads", config, calib_tokens=256, seq_len=32, progress=False)
    with CheckpointReader(tmp_path / "heads") as reader:
        assert reader.config["moecompress"].get("attention_heads_per_layer")
    _compare_windows(tmp_path / "heads", source)


def _windows(adapter, count: int = 3, seq_len: int = 16):
    """Windows of random tokens; an encoder-decoder's span corruption of them (its vocabulary's last ids as the
    sentinels)."""
    vocab = int(adapter.text_config["vocab_size"])
    ids = torch.randint(0, vocab, (count, seq_len), generator=torch.Generator().manual_seed(0))
    if adapter.encoder_output_norm is None:
        return TokenWindows(input_ids=ids, tags=torch.zeros_like(ids), tag_names=["text"])
    sentinels = list(range(vocab - 1, vocab - 1 - SENTINELS, -1))
    start = int(adapter.config["decoder_start_token_id"])
    return corrupt_spans(ids, torch.zeros_like(ids), sentinels, int(adapter.config["eos_token_id"]), start, 0)


def _compare_windows(model_dir, reference_dir):
    with CheckpointReader(model_dir) as reader:
        adapter = adapter_for(reader.config)
    with CheckpointReader(reference_dir) as reader:
        ref_adapter = adapter_for(reader.config)
    windows = _windows(adapter)
    got = streamed.evaluate_streamed(model_dir, windows, reference_dir, progress=False)
    model, reference = load_model(model_dir, adapter), load_model(reference_dir, ref_adapter)
    want = evaluate_windows(model, adapter, windows, (reference, ref_adapter), progress=False)
    assert_same_figures(got, want)
    return got


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_quantized_against_its_original(family, tiny_checkpoints, tmp_path):
    source = tiny_checkpoints[family]
    quantize_checkpoint(source, tmp_path / "q", QuantizeConfig(scheme="mxfp4"), progress=False)
    result = _compare_windows(tmp_path / "q", source)
    assert result.kl > 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_against_itself(family, tiny_checkpoints):
    result = _compare_windows(tiny_checkpoints[family], tiny_checkpoints[family])
    assert result.kl == 0.0


def test_exports_for_other_loaders_fall_back_to_the_whole_model(tiny_checkpoints, tmp_path):
    source = tiny_checkpoints["gpt_oss"]
    quantize_checkpoint(source, tmp_path / "export", QuantizeConfig(format="gpt-oss"), progress=False)
    assert "mxfp4" in streamed.whole_model_reason(tmp_path / "export")
    assert streamed.whole_model_reason(source) is None
