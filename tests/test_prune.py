"""`moecompress prune`: outputs load where they should, claim honest numbers, and MAEP uses its signals."""

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from helpers import tree_hashes

from moecompress.checkpoint import CheckpointReader
from moecompress.cli.main import app
from moecompress.families import MoEWeights, adapter_for
from moecompress.passes.prune_experts import PruneExpertsConfig, choose_removals, score_layer
from moecompress.sweep.engine import LayerCapture

PLAIN_PERPLEXITY = r"""
import json, math, sys
if sys.argv[5] == "plugin-first":
    import moecompress
    assert "transformers.modeling_utils" not in sys.modules
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
if sys.argv[5] == "plugin":
    import moecompress
assert ("moecompress" in sys.modules) == (sys.argv[5] != "stock")
path, seq_len, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
texts = json.load(open(sys.argv[4]))
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
ids = [token for text in texts for token in tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]]
count = min(len(ids) // seq_len, max_tokens // seq_len)
losses = []
with torch.no_grad():
    for i in range(count):
        window = torch.tensor([ids[i * seq_len:(i + 1) * seq_len]])
        losses.append(model(input_ids=window, labels=window).loss.item())
print(json.dumps({"perplexity": math.exp(sum(losses) / len(losses))}))
"""


def _stock_perplexity(path, with_plugin, tmp_path, plugin_first=False):
    """Perplexity of held-out prose computed in a fresh interpreter with plain transformers; ``import
    moecompress`` after transformers, or before it with ``plugin_first``."""
    from moecompress.calibration.builtin_corpus import builtin_documents

    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps([doc.text for doc in builtin_documents("prose", "heldout")]))
    mode = ("plugin-first" if plugin_first else "plugin") if with_plugin else "stock"
    return subprocess.run(
        [sys.executable, "-c", PLAIN_PERPLEXITY, str(path), "256", "4096", str(texts), mode],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # one thread: the import-order test compares printed digits
    )


@pytest.fixture(scope="module")
def pruned_outputs(tmp_path_factory):
    from moecompress.checkpoint import resolve_model

    source = resolve_model("builtin:tiny-moe")
    before = tree_hashes(source)
    root = tmp_path_factory.mktemp("pruned")
    outputs = {}
    for scope in ("layer", "global"):
        out = root / scope
        result = CliRunner().invoke(
            app,
            [
                "prune",
                "builtin:tiny-moe",
                "--out",
                str(out),
                "--ratio",
                "0.25",
                "--scope",
                scope,
                "--calib-tokens",
                "4096",
                "--eval-tokens",
                "4096",
            ],
        )
        assert result.exit_code == 0, result.output
        outputs[scope] = out
    assert tree_hashes(source) == before, "the input checkpoint must not change"
    return source, outputs


def test_layer_scope_loads_in_stock_transformers_with_the_claimed_perplexity(pruned_outputs, tmp_path):
    _, outputs = pruned_outputs
    report = json.loads((outputs["layer"] / "moecompress_report.json").read_text())
    config = json.loads((outputs["layer"] / "config.json").read_text())
    assert config["num_local_experts"] == 6 and report["uniform"]
    result = _stock_perplexity(outputs["layer"], False, tmp_path)
    assert result.returncode == 0, result.stderr
    stock = json.loads(result.stdout)["perplexity"]
    assert stock == pytest.approx(report["eval"]["perplexity"], rel=0.005)


def test_global_scope_loads_after_import_moecompress(pruned_outputs, tmp_path):
    _, outputs = pruned_outputs
    report = json.loads((outputs["global"] / "moecompress_report.json").read_text())
    counts = [len(layer["kept"]) for layer in report["layers"].values()]
    assert sum(counts) == 24 and len(set(counts)) > 1 and not report["uniform"]
    with_plugin = _stock_perplexity(outputs["global"], True, tmp_path)
    assert with_plugin.returncode == 0, with_plugin.stderr
    assert json.loads(with_plugin.stdout)["perplexity"] == pytest.approx(report["eval"]["perplexity"], rel=0.005)
    first = _stock_perplexity(outputs["global"], True, tmp_path, plugin_first=True)
    assert first.returncode == 0, first.stderr
    assert first.stdout == with_plugin.stdout
    without = _stock_perplexity(outputs["global"], False, tmp_path)
    assert without.returncode != 0, "stock transformers must refuse the non-uniform checkpoint, not misload it"


def test_report_and_tensors_agree(pruned_outputs):
    source, outputs = pruned_outputs
    out = outputs["global"]
    report = json.loads((out / "moecompress_report.json").read_text())
    with CheckpointReader(source) as original, CheckpointReader(out) as pruned:
        for layer, entry in report["layers"].items():
            layer = int(layer)
            assert sorted(entry["kept"] + entry["removed"]) == list(range(8))
            assert len(entry["score"]) == len(entry["frequency"]) == len(entry["reap"]) == 8
            router = original.tensor(f"model.layers.{layer}.mlp.gate.weight")
            assert torch.equal(pruned.tensor(f"model.layers.{layer}.mlp.gate.weight"), router[entry["kept"]])
            for position, expert in enumerate(entry["kept"]):
                key = f"model.layers.{layer}.mlp.experts.{{}}.down_proj.weight"
                assert torch.equal(pruned.tensor(key.format(position)), original.tensor(key.format(expert)))
            if entry["removed"]:
                removed_score = max(entry["score"][e] for e in entry["removed"])
                assert removed_score <= max(entry["score"][e] for e in entry["kept"])
        assert adapter_for(pruned.config).original_expert_ids(1) == report["layers"]["1"]["kept"]


def test_group_limited_router_prunes_evenly_per_group(tiny_with_tokenizer, tmp_path):
    out = tmp_path / "ds3"
    result = CliRunner().invoke(
        app,
        [
            "prune",
            str(tiny_with_tokenizer["deepseek_v3"]),
            "--out",
            str(out),
            "--ratio",
            "0.5",
            "--calib-tokens",
            "512",
            "--seq-len",
            "64",
            "--eval-tokens",
            "512",
            "--method",
            "reap",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "moecompress_report.json").read_text())
    for entry in report["layers"].values():
        assert sorted(e // 4 for e in entry["kept"]) == [0, 0, 1, 1], "two experts of each 4-expert group kept"
    too_many = CliRunner().invoke(
        app,
        [
            "prune",
            str(tiny_with_tokenizer["deepseek_v3"]),
            "--out",
            str(tmp_path / "t"),
            "--ratio",
            "0.75",
            "--calib-tokens",
            "512",
            "--seq-len",
            "64",
            "--no-eval",
        ],
    )
    assert too_many.exit_code != 0 and "at least 2 per group" in str(too_many.exception)
    refused = CliRunner().invoke(
        app,
        [
            "prune",
            str(tiny_with_tokenizer["deepseek_v3"]),
            "--out",
            str(tmp_path / "g"),
            "--ratio",
            "0.5",
            "--scope",
            "global",
            "--calib-tokens",
            "512",
            "--seq-len",
            "64",
            "--no-eval",
        ],
    )
    assert refused.exit_code != 0 and "group-limited" in str(refused.exception)


def _vision_capture():
    """A layer where experts 0 and 1 serve only vision tokens (92% of tokens, all receiving little attention)
    and experts 2 and 3 serve the text tokens."""
    from moecompress.families.qwen_moe import Qwen3MoeAdapter

    hidden_size, inter = 8, 4
    adapter = Qwen3MoeAdapter(
        {
            "model_type": "qwen3_moe",
            "num_hidden_layers": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "hidden_size": hidden_size,
            "num_attention_heads": 2,
            "norm_topk_prob": True,
        }
    )
    generator = torch.Generator().manual_seed(0)
    router = torch.zeros(4, hidden_size)
    router[0, 0] = router[1, 0] = 4.0
    router[2, 1] = router[3, 1] = 4.0
    router[:, 2:] = 0.1 * torch.randn(4, hidden_size - 2, generator=generator)
    moe = MoEWeights(
        router_weight=router,
        gate_up=torch.randn(4, 2 * inter, hidden_size, generator=generator),
        down=torch.randn(4, hidden_size, inter, generator=generator),
        expert_ids=[0, 1, 2, 3],
    )
    vision, text = 1200, 100
    x = 0.3 * torch.randn(vision + text, hidden_size, generator=generator)
    x[:vision, 0] += 2.0
    x[vision:, 1] += 2.0
    tags = torch.tensor([1] * vision + [0] * text)
    attention = torch.cat([0.01 * torch.rand(vision, generator=generator), 0.5 + torch.rand(text, generator=generator)])
    capture = LayerCapture(
        layer=0, moe=moe, moe_input=x, tags=tags, tag_names=["text", "vision"], attention_received=attention
    )
    return adapter, capture


def test_maep_ranks_low_attention_vision_experts_prunable():
    adapter, capture = _vision_capture()
    aware = PruneExpertsConfig(method="maep", ratio=0.5, prune_tags=("vision",), low_attention_fraction=0.5)
    agnostic = PruneExpertsConfig(method="maep", ratio=0.5)
    aware_removed = choose_removals([score_layer(adapter, capture, aware)], aware, top_k=2)
    agnostic_removed = choose_removals([score_layer(adapter, capture, agnostic)], agnostic, top_k=2)
    assert aware_removed == {0: [0, 1]}
    assert agnostic_removed == {0: [2, 3]}, "a modality-agnostic ΔH keeps the heavily used vision experts"


def test_bad_ratio_is_a_one_line_error(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "moecompress.cli.main",
            "prune",
            "builtin:tiny-moe",
            "--out",
            str(tmp_path / "x"),
            "--ratio",
            "1.5",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "--ratio 1.5 must be between 0 and 1" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def _image_dataset(directory):
    import datasets
    import numpy as np
    from PIL import Image

    from moecompress.calibration.vision import builtin_image_captions

    items = builtin_image_captions("stripes", count=4, size=32, seed=5)
    dataset = datasets.Dataset.from_dict(
        {"image": [Image.fromarray(i.image) for i in items], "caption": [i.caption for i in items]}
    )
    dataset = dataset.cast_column("image", datasets.Image())
    (directory / "data").mkdir(parents=True)
    dataset.to_parquet(str(directory / "data" / "train-00000-of-00001.parquet"))
    return np


@pytest.mark.parametrize("calib", ["builtin:shapes:6", "hf-local"])
def test_vision_language_pruning_with_images(calib, tiny_with_tokenizer, tmp_path):
    source = tiny_with_tokenizer["qwen3_vl_moe"]
    if calib == "hf-local":
        _image_dataset(tmp_path / "images")
        calib = f"hf:{tmp_path / 'images'}"
    out = tmp_path / "vl"
    result = CliRunner().invoke(
        app,
        [
            "prune",
            str(source),
            "--out",
            str(out),
            "--ratio",
            "0.5",
            "--calib",
            calib,
            "--image-size",
            "32",
            "--prune-tags",
            "vision",
            "--eval-tokens",
            "512",
            "--seq-len",
            "64",
        ],
    )
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads((out / "moecompress_report.json").read_text())
    assert report["calibration"]["tags"] == ["text", "vision"]
    assert report["calibration"]["tag_counts"][1] > 0
    for entry in report["layers"].values():
        assert entry["maep"]["prune_tokens"] > 0 and entry["maep"]["preserve_tokens"] > 0
        assert len(entry["kept"]) == 2
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(out)
    assert model.config.text_config.num_experts == 2
