"""Every family end to end on a tiny checkpoint in its hub release's layout: `prune --scope layer` writes what stock
transformers loads, `quantize` writes what loads through the plugin, and the perplexity each command reports is
the one plain transformers computes on the written model."""

import json
import shutil

import pytest
import torch
import transformers
from click.testing import CliRunner
from helpers import plain_perplexity
from synthetic import FAMILIES, tiny_tokenizer_for

from moecompress.cli.main import app
from moecompress.families import adapter_for

E2E_FAMILIES = FAMILIES
SEQ_LEN, TOKENS = 64, 512


@pytest.fixture(scope="module")
def with_tokenizer(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    made = {}

    def get(family):
        if family not in made:
            made[family] = root / family
            shutil.copytree(tiny_checkpoints[family], made[family])
            tiny_tokenizer_for(family).save_pretrained(made[family])
        return made[family]

    return get


def _config(directory):
    return json.loads((directory / "config.json").read_text())


def _plain_perplexity(directory):
    return plain_perplexity(directory, SEQ_LEN, TOKENS)


def _run(command, source, out, *args):
    calibration = ["--calib-tokens", "512"] if command == "prune" else []  # int4 RTN reads no calibration
    options = [*calibration, "--seq-len", str(SEQ_LEN), "--eval-tokens", str(TOKENS)]
    result = CliRunner().invoke(app, [command, str(source), "--out", str(out), *options, *args])
    assert result.exit_code == 0, result.output
    return json.loads((out / "moecompress_report.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_layer_scope_prune_loads_in_stock_transformers_with_the_reported_perplexity(family, with_tokenizer, tmp_path):
    source = with_tokenizer(family)
    adapter = adapter_for(_config(source))
    out = tmp_path / "pruned"
    kept = adapter.num_experts // 2
    report = _run("prune", source, out, "--keep", str(kept), "--scope", "layer")
    pruned = adapter_for(_config(out))
    assert pruned.num_experts == kept and report["uniform"]

    config = pruned.transformers_config()
    _, loading = getattr(transformers, pruned.auto_class).from_pretrained(
        out, dtype=torch.float32, output_loading_info=True, **({} if config is None else {"config": config})
    )
    assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    perplexity, model = _plain_perplexity(out)
    per_module = kept // len(pruned.experts_modules())  # ERNIE 4.5 VL: a text and a vision set, each with a router
    for layer in pruned.moe_layers():
        assert pruned.stock_experts_weights(pruned.experts_of(model, layer))[1].shape[0] == per_module
        hashed = pruned.family == "deepseek_v4" and pruned.hash_layer(layer)  # its router also takes the token ids
        routed_by = {"token_ids": torch.zeros(1, dtype=torch.long)} if hashed else {}
        logits = pruned.stock_route(model, layer, torch.zeros(1, pruned.shape().hidden_size), **routed_by)[0]
        assert logits.shape[-1] == per_module + pruned.identity_experts(layer)
    assert perplexity == pytest.approx(report["eval"]["perplexity"], rel=1e-4)
    assert _plain_perplexity(source)[0] == pytest.approx(report["eval"]["reference_perplexity"], rel=1e-4)


@pytest.mark.parametrize("family", E2E_FAMILIES)
def test_quantized_output_loads_through_the_plugin_with_the_reported_perplexity(family, with_tokenizer, tmp_path):
    source = with_tokenizer(family)
    out = tmp_path / "quantized"
    report = _run("quantize", source, out, "--scheme", "int4", "--group-size", "32")
    adapter = adapter_for(_config(out))
    perplexity, model = _plain_perplexity(out)
    for layer in adapter.moe_layers():
        assert type(adapter.experts_of(model, layer)).__name__ == "QuantizedExperts"
    assert perplexity == pytest.approx(report["eval"]["perplexity"], rel=1e-4)


TEXT_ONLY_AUTO_FAMILIES = ("llama4", "qwen3_5_moe")
"""Vision-language releases from whose config `AutoModelForCausalLM` builds the text-only class
(`Llama4ForCausalLM`, `Qwen3_5MoeForCausalLM`: decoder layers under `model.layers`, not `language_model.`)."""


@pytest.mark.parametrize("family", TEXT_ONLY_AUTO_FAMILIES)
def test_quantized_vision_language_output_loads_text_only_through_auto_model_for_causal_lm(
    family, with_tokenizer, tmp_path
):
    out = tmp_path / "quantized"
    _run("quantize", with_tokenizer(family), out, "--scheme", "int4", "--group-size", "32")
    full = getattr(transformers, adapter_for(_config(out)).auto_class).from_pretrained(out, dtype=torch.float32)
    text, loading = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not loading["missing_keys"] and not loading["mismatched_keys"], loading
    text_adapter = adapter_for(text.config.to_dict())
    for layer in text_adapter.moe_layers():
        assert type(text_adapter.experts_of(text, layer)).__name__ == "QuantizedExperts"
    ids = torch.arange(48).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(text.eval()(input_ids=ids).logits, full.eval()(input_ids=ids).logits)


FP8_FAMILIES = ("glm4_moe", "kimi_k2", "qwen3_next", "minimax_m2")
"""Families whose hub releases ship block-FP8 (GLM-4.5-FP8, Kimi-K2, Qwen3-Next-*-FP8, MiniMax-M2)."""


@pytest.fixture(scope="module")
def fp8_release(with_tokenizer, tmp_path_factory):
    from synthetic_quantized import convert_to_block_fp8

    root = tmp_path_factory.mktemp("fp8")
    return lambda family: convert_to_block_fp8(with_tokenizer(family), root / family)


@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_fp8_release_prunes_in_its_format_and_quantizes(family, fp8_release, tmp_path):
    """A block-FP8 release: `prune` keeps FP8 (kept experts' codes and scales byte for byte) and stock transformers
    loads the output with the reported perplexity; `quantize` decodes it and the output loads through the plugin
    with the reported perplexity."""
    from safetensors import safe_open

    source = fp8_release(family)
    adapter = adapter_for(_config(source))
    kept = adapter.num_experts // 2
    pruned = tmp_path / "pruned"
    report = _run("prune", source, pruned, "--keep", str(kept), "--scope", "layer")
    assert _config(pruned)["quantization_config"] == _config(source)["quantization_config"]
    layer = adapter.moe_layers()[-1]
    ids = report["layers"][str(layer)]["kept"]
    with (
        safe_open(source / "model.safetensors", "pt") as before,
        safe_open(pruned / "model.safetensors", "pt") as after,
    ):
        for position, expert in enumerate(ids):
            for suffix in ("", "_scale_inv"):
                original = before.get_tensor(adapter._expert_key(layer, expert, 2) + suffix)
                written = after.get_tensor(adapter._expert_key(layer, position, 2) + suffix)
                assert written.dtype == original.dtype and torch.equal(
                    written.view(torch.uint8), original.view(torch.uint8)
                )
    assert _plain_perplexity(pruned)[0] == pytest.approx(report["eval"]["perplexity"], rel=1e-4)

    quantized = tmp_path / "quantized"
    report = _run("quantize", source, quantized, "--scheme", "int4", "--group-size", "32")
    perplexity, model = _plain_perplexity(quantized)
    assert type(adapter.experts_of(model, layer)).__name__ == "QuantizedExperts"
    assert perplexity == pytest.approx(report["eval"]["perplexity"], rel=1e-4)
