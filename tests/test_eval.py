"""`moecompress eval`: the perplexity definition, KL and routing agreement."""

import json
import math

import pytest
import torch
from click.testing import CliRunner
from helpers import rewrite_checkpoint

from moecompress.calibration.builtin_corpus import builtin_documents
from moecompress.checkpoint import CheckpointReader
from moecompress.cli.main import app
from moecompress.evals.perplexity import evaluate
from moecompress.families import adapter_for
from moecompress.loading import load_model, load_tokenizer


def plain_transformers_perplexity(model_dir, seq_len, max_tokens):
    """The definition computed the obvious way: labels-based loss per window, windows weighted equally."""
    tokenizer = load_tokenizer(model_dir)
    with CheckpointReader(model_dir) as reader:
        model = load_model(model_dir, adapter_for(reader.config))
    ids = []
    for doc in builtin_documents("prose", "heldout"):
        ids.extend(tokenizer(doc.text + "\n\n", add_special_tokens=False)["input_ids"])
    count = min(len(ids) // seq_len, max_tokens // seq_len)
    losses = []
    with torch.no_grad():
        for i in range(count):
            window = torch.tensor([ids[i * seq_len : (i + 1) * seq_len]])
            losses.append(model(input_ids=window, labels=window).loss.item())
    return math.exp(sum(losses) / len(losses)), count * (seq_len - 1)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_eval_perplexity_matches_plain_transformers(family, tiny_with_tokenizer, tmp_path):
    model_dir = tiny_with_tokenizer[family]
    out = tmp_path / "result.json"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            str(model_dir),
            "--data",
            "builtin:prose",
            "--seq-len",
            "64",
            "--max-tokens",
            "2048",
            "--json-out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    expected, predicted = plain_transformers_perplexity(model_dir, 64, 2048)
    assert report["tokens"] == predicted == 32 * 63
    assert abs(report["perplexity"] - expected) / expected < 0.005
    assert report["tokens_per_second"] > 0
    assert "kl" not in report and "routing_agreement" not in report


def _permute_experts(source, out, permutation):
    """A functionally identical model whose experts are stored in another order (as after pruning)."""
    with CheckpointReader(source) as reader:
        adapter = adapter_for(reader.config)
    kept = {layer: permutation for layer in adapter.moe_layers()}
    config = adapter.with_expert_counts({layer: len(permutation) for layer in kept}, kept)
    rewrite_checkpoint(source, out, lambda layer, moe: moe.select(permutation), config=config)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).exists()
    return out


def test_reference_metrics_map_pruned_ids_back(tiny_with_tokenizer, tmp_path):
    source = tiny_with_tokenizer["deepseek_v3"]
    # DeepSeek-V3 routes within groups of 4 consecutive experts: keep each group together.
    permuted = _permute_experts(source, tmp_path / "perm", [6, 4, 7, 5, 1, 3, 0, 2])
    result = evaluate(permuted, "builtin:prose", seq_len=32, max_tokens=512, reference_dir=source, progress=False)
    baseline = evaluate(source, "builtin:prose", seq_len=32, max_tokens=512, progress=False)
    assert result.routing_agreement == pytest.approx(1.0)
    assert result.kl == pytest.approx(0.0, abs=1e-6)
    assert result.perplexity == pytest.approx(baseline.perplexity, rel=1e-5)


def test_routing_agreement_drops_when_experts_are_removed(tiny_with_tokenizer, tmp_path):
    source = tiny_with_tokenizer["qwen3_moe"]
    pruned = _permute_experts(source, tmp_path / "pruned", [0, 1, 2, 3, 4, 5])
    result = evaluate(pruned, "builtin:prose", seq_len=32, max_tokens=512, reference_dir=source, progress=False)
    assert 0.0 < result.routing_agreement < 1.0
    assert result.kl > 0.0
