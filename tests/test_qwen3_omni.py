"""Qwen3-Omni's release (thinker, talker, code2wav): the thinker's decoder layers are compressed on the thinker built
alone, everything else passes through unchanged, and the release class loads the outputs."""

import json

import pytest
import torch
import transformers
from click.testing import CliRunner
from helpers import load_stock
from safetensors.torch import load_file
from synthetic import save_tiny_source

from moecompress.checkpoint import CheckpointReader
from moecompress.cli.main import app
from moecompress.families import adapter_for
from moecompress.hub import build_card

PASSED_THROUGH = ("talker.", "code2wav.", "thinker.audio_tower.", "thinker.visual.")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = save_tiny_source("qwen3_omni_moe", tmp_path_factory.mktemp("qwen3_omni_moe") / "source")
    return directory


def _run(*args):
    result = CliRunner().invoke(app, [str(arg) for arg in args])
    assert result.exit_code == 0, result.output


def _ids():
    return torch.randint(3, 384, (2, 24), generator=torch.Generator().manual_seed(0))


def test_the_thinker_layers_are_the_view_and_the_rest_is_passed_through(checkpoint):
    with CheckpointReader(checkpoint) as reader:
        adapter = adapter_for(reader.config)
        keys = list(reader.keys())
        prefix = adapter.layer_prefix(1)
        moe, _, layout = adapter.split_layer(1, reader.read(k for k in keys if k.startswith(prefix)))
    assert adapter.family == "qwen3_omni_moe" and adapter.moe_layers() == [0, 1] and layout == "per_expert"
    assert tuple(moe.gate_up.shape) == (8, 64, 64) and tuple(moe.router_weight.shape) == (8, 64)
    talker_experts = [key for key in keys if key.startswith("talker.model.layers.") and ".mlp.experts." in key]
    assert talker_experts and {adapter.layer_of_key(key) for key in talker_experts} == {None}
    assert {adapter.classify_key(key) for key in keys if key.startswith(PASSED_THROUGH[2:])} == {"vision"}
    assert {adapter.classify_key(key) for key in keys if key.startswith(PASSED_THROUGH[:2])} == {"other"}
    assert all(adapter.is_vision_key(key) for key in keys if key.startswith(PASSED_THROUGH))
    runtime = adapter.runtime_module_name("thinker.model.layers.1.mlp.experts")
    assert runtime == "model.language_model.layers.1.mlp.experts"


def test_the_thinker_built_alone_is_the_release_thinker(checkpoint):
    release = transformers.AutoModelForMultimodalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    thinker = load_stock(checkpoint)
    assert type(thinker).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    with torch.no_grad():
        assert torch.equal(thinker(input_ids=_ids()).logits, release.thinker(input_ids=_ids()).logits)


def test_prune_keeps_the_talker_and_towers_and_the_release_class_loads_the_output(checkpoint, tmp_path):
    out = tmp_path / "pruned"
    _run("prune", checkpoint, "--out", out, "--keep", 4, "--scope", "layer", "--calib-tokens", 512, "--seq-len", 64,
         "--eval-tokens", 256)  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["thinker_config"]["text_config"]["num_experts"] == 4
    assert config["talker_config"]["text_config"]["num_local_experts"] == 8
    source, pruned = load_file(checkpoint / "model.safetensors"), load_file(out / "model.safetensors")
    for key in (key for key in source if key.startswith(PASSED_THROUGH)):
        assert torch.equal(pruned[key], source[key]), key
    assert not any(key.startswith("thinker.model.layers.0.mlp.experts.4.") for key in pruned)
    _, loading = transformers.AutoModelForMultimodalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
    card = build_card(out, json.loads((out / "moecompress_report.json").read_text()), repo_id="acme/omni-pruned")
    assert 'model = AutoModelForMultimodalLM.from_pretrained("acme/omni-pruned")' in card.text


def test_the_release_class_loads_the_quantised_output_through_the_plugin(checkpoint, tmp_path):
    import moecompress  # noqa: F401 - the plugin

    out = tmp_path / "mxfp4"
    _run("quantize", checkpoint, "--out", out, "--scheme", "mxfp4", "--seq-len", 64, "--eval-tokens", 256)
    release = transformers.AutoModelForMultimodalLM.from_pretrained(out, dtype=torch.float32).eval()
    source = transformers.AutoModelForMultimodalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for layer in (0, 1):
        assert type(release.thinker.model.language_model.layers[layer].mlp.experts).__name__ == "QuantizedExperts"
        talker = release.talker.model.layers[layer].mlp.experts
        assert type(talker).__name__ == "Qwen3OmniMoeTalkerTextExperts"
        assert torch.equal(talker.gate_up_proj, source.talker.model.layers[layer].mlp.experts.gate_up_proj)
    with torch.no_grad():
        assert torch.isfinite(release.thinker(input_ids=_ids()).logits).all()
