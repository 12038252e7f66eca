"""What a family's tiny checkpoint does not exercise in the shared family tests: other router modes (checked against
the stock router module), refusals."""

import pytest
import torch
from synthetic import TINY_CONFIGS, tiny_config

from moecompress.families import adapter_for


@pytest.mark.parametrize(
    "overrides",
    [
        {"expert_selection_fn": "softmax"},
        {"expert_selection_fn": "sigmoid", "norm_topk_prob": True},
        {"expert_selection_fn": "sigmoid", "norm_topk_prob": False},
    ],
    ids=["softmax", "sigmoid-normalised", "sigmoid"],
)
def test_cohere2_moe_router_modes_match_the_stock_router(overrides):
    from transformers.models.cohere2_moe.modeling_cohere2_moe import Cohere2MoeTopKRouter

    config = tiny_config("cohere2_moe")
    for key, value in overrides.items():
        setattr(config, key, value)
    adapter = adapter_for(dict(TINY_CONFIGS["cohere2_moe"], **overrides))
    generator = torch.Generator().manual_seed(0)
    router = Cohere2MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=generator))
    hidden = torch.randn(64, config.hidden_size, generator=generator)
    with torch.no_grad():
        logits, stock_weights, stock_ids = router(hidden)
    ids, weights = adapter.routing_rule().route(logits)
    order_stock, order_ours = stock_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(stock_ids.gather(1, order_stock), ids.gather(1, order_ours))
    torch.testing.assert_close(stock_weights.gather(1, order_stock), weights.gather(1, order_ours))


def test_quantizing_sarvam_attention_is_refused_before_work(tiny_checkpoints, tmp_path):
    """Sarvam's q/k/v live in one tensor that transformers splits at load: no runtime module holds it."""
    from helpers import run_cli

    out = tmp_path / "q"
    source = tiny_checkpoints["sarvam_moe"]
    result = run_cli("quantize", str(source), "--out", str(out), "--targets", "experts,attention")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "sarvam_moe stores its attention weights fused" in lines[0]
    assert not out.exists()


def test_kimi_linear_attention_kinds_from_the_release_config_match_transformers():
    """Kimi-Linear releases list 1-based ``full_attn_layers``/``kda_layers`` instead of ``layer_types``."""
    from transformers import KimiLinearConfig

    linear = {"full_attn_layers": [2, 4], "kda_layers": [1, 3, 5], "head_dim": 16, "num_heads": 4}
    config = {
        "model_type": "kimi_linear",
        "num_hidden_layers": 5,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "linear_attn_config": linear,
    }
    expected = KimiLinearConfig(num_hidden_layers=5, linear_attn_config=linear).layer_types
    adapter = adapter_for(config)
    assert [adapter.softmax_attention(i) for i in range(5)] == [kind == "full_attention" for kind in expected]
    assert adapter.top_k == 2


KIMI_K2_STOCK_LOAD = 'DeepseekV3ForCausalLM.from_pretrained(DIR, model_type="deepseek_v3")'


def test_kimi_k2_stock_load_stated_in_the_docs_loads_the_release_and_its_outputs(tmp_path):
    """Kimi-K2's ``config.json`` keeps ``model_type: kimi_k2``, for which transformers has no rule merging the
    per-expert tensors: ``DeepseekV3ForCausalLM.from_pretrained(DIR)`` alone leaves the routed experts random."""
    from pathlib import Path

    from click.testing import CliRunner
    from helpers import load_stock
    from synthetic import save_tiny_source
    from transformers import DeepseekV3ForCausalLM

    from moecompress.cli.main import app

    assert KIMI_K2_STOCK_LOAD in (Path(__file__).parents[1] / "docs" / "families.md").read_text()
    release = save_tiny_source("kimi_k2", tmp_path / "release")
    commands = {
        "pruned": ["prune", "--keep", "4", "--calib-tokens", "256"],
        "quantized": ["quantize", "--scheme", "int4", "--group-size", "32"],
    }
    for name, (command, *options) in commands.items():
        out = ["--out", str(tmp_path / name), "--seq-len", "32", "--eval-tokens", "64"]
        result = CliRunner().invoke(app, [command, str(release), *out, *options])
        assert result.exit_code == 0, result.output
    ids = torch.arange(40).unsqueeze(0)
    for directory in (release, tmp_path / "pruned", tmp_path / "quantized"):
        model, loading = DeepseekV3ForCausalLM.from_pretrained(
            directory, model_type="deepseek_v3", dtype=torch.float32, output_loading_info=True
        )
        assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(input_ids=ids).logits, load_stock(directory)(input_ids=ids).logits)


def test_kimi_k25_in_save_pretrained_layout_is_read_pruned_and_quantised_as_its_release(tmp_path):
    """``save_pretrained`` of the stock Kimi-K2.5 class writes ``language_model.model.blocks.*`` (text config
    ``model_type: deepseek_v3``); the release writes ``language_model.model.layers.*`` (``kimi_k2``). Both hold the
    same model: inspect counts the same classes, prune keeps the same experts and writes what stock transformers
    loads, quantize writes what loads through the plugin, each in the layout read."""
    import json

    import transformers
    from click.testing import CliRunner
    from safetensors import safe_open
    from synthetic import build_tiny_model, save_tiny_model, tiny_tokenizer

    from moecompress.cli.main import app
    from moecompress.evals.checkpoint_summary import summarize

    saved, release = tmp_path / "saved", tmp_path / "release"
    build_tiny_model("kimi_k25").save_pretrained(saved)
    save_tiny_model("kimi_k25", release)
    for directory in (saved, release):
        tiny_tokenizer().save_pretrained(directory)
    with safe_open(saved / "model.safetensors", "pt") as shard:
        assert any(key.startswith("language_model.model.blocks.") for key in shard.keys())
    assert summarize(saved)["parameters"] == summarize(release)["parameters"]

    def run(command, source, *options):
        out = tmp_path / f"{command}-{source.name}"
        args = [command, str(source), "--out", str(out), "--seq-len", "32", "--eval-tokens", "64", *options]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        return out, json.loads((out / "moecompress_report.json").read_text())

    pruned, report = run("prune", saved, "--keep", "4", "--calib-tokens", "256")
    assert report["layers"] == run("prune", release, "--keep", "4", "--calib-tokens", "256")[1]["layers"]
    quantized, _ = run("quantize", saved, "--scheme", "int4", "--group-size", "32")
    adapter = adapter_for(json.loads((saved / "config.json").read_text()))
    for out in (pruned, quantized):
        with safe_open(out / "model.safetensors", "pt") as shard:
            assert not any(key.startswith("language_model.model.layers.") for key in shard.keys())
        model, loading = transformers.AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
        assert not any(loading[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), loading
        for layer in adapter.moe_layers():
            experts = adapter.experts_of(model, layer)
            if out == pruned:
                assert experts.gate_up_proj.shape[0] == 4
            else:
                assert type(experts).__name__ == "QuantizedExperts"


def test_minimax_m3_layer_kinds_from_the_release_config_match_transformers():
    """MiniMax-M3's release lists its MoE and sparse-attention layers as ``moe_layer_freq`` and
    ``sparse_attention_config.sparse_attention_freq`` flags, which transformers turns into its per-layer lists."""
    from transformers import MiniMaxM3VLTextConfig

    release = {"moe_layer_freq": [0, 1, 1, 0], "sparse_attention_config": {"sparse_attention_freq": [0, 1, 0, 1]}}
    expected = MiniMaxM3VLTextConfig(num_hidden_layers=4, **release)
    config = {"model_type": "minimax_m3_vl_text", "num_hidden_layers": 4, "num_local_experts": 8, **release}
    adapter = adapter_for(dict(config, num_experts_per_tok=2))
    assert adapter.moe_layers() == [i for i, kind in enumerate(expected.mlp_layer_types) if kind == "sparse"]
    assert [adapter.softmax_attention(i) for i in range(4)] == [k == "full_attention" for k in expected.layer_types]


STOCK_FAILURES = {
    "hidden_act": ({"hidden_act": "bogus"}, "cannot build the qwen3_moe model from config.json: KeyError: 'bogus'"),
    "rope_type": (
        {"rope_parameters": {"rope_type": "bogus", "rope_theta": 10000.0}},
        "cannot build the qwen3_moe model from config.json: KeyError: 'bogus'",
    ),
    "field_type": ({"rms_norm_eps": "x"}, "cannot read config.json: TypeError: Field 'rms_norm_eps' expected float"),
    "layer_types": ({"layer_types": ["bogus", "full_attention"]}, "cannot read config.json: ValueError: The `layer_"),
    "top_k": ({"num_experts_per_tok": 20}, "config.json routes each token to 20 experts, more than the 8 of layer 0"),
}
"""Configs stock transformers cannot read, build or run (each otherwise a torch or transformers traceback)."""


@pytest.mark.parametrize("command", ["prune", "eval"])
@pytest.mark.parametrize("case", list(STOCK_FAILURES))
def test_config_stock_transformers_cannot_run_is_one_line_exit_2_before_work(case, command, tmp_path):
    import json

    from helpers import run_cli
    from synthetic import save_tiny_source

    patch, message = STOCK_FAILURES[case]
    source = save_tiny_source("qwen3_moe", tmp_path / "model")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, **patch}))
    out = tmp_path / "out"
    options = ["--out", str(out), "--keep", "4", "--calib-tokens", "128"] if command == "prune" else []
    result = run_cli(command, str(source), *options, "--seq-len", "32", "--eval-tokens", "64")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"moecompress: error: {source}: ") and message in lines[0]
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_stock_failures_leave_moecompress_errors_alone():
    """Only what transformers raises becomes one line; a failure in moecompress's own code keeps its traceback."""
    from transformers.activations import ACT2FN

    from moecompress.checkpoint.stock_model import stock_failures
    from moecompress.errors import UserInputError

    adapter = adapter_for(dict(TINY_CONFIGS["qwen3_moe"], hidden_act="gelu"))
    with pytest.raises(ValueError, match="unsupported expert activation"), stock_failures("model", "build it"):
        adapter.activation(torch.zeros(1), torch.zeros(1))
    with pytest.raises(UserInputError, match=r"^model: stock transformers .* cannot build it: KeyError: 'bogus'"):
        with stock_failures("model", "build it"):
            ACT2FN["bogus"]


def test_ergo_experts_normalise_with_their_own_weights_when_pruned_and_quantised(tmp_path):
    """Ergo's experts each RMS-normalise their output with a weight of their own: a pruned output keeps the kept
    experts' weights (stock transformers routes as the input with the removed experts masked, exactly), and the
    plugin's quantised experts apply each expert's own weight (with the weights' rows swapped, the quantised model's
    logits move far further from the input's than quantisation moved them)."""
    import json

    from click.testing import CliRunner
    from helpers import load_stock
    from safetensors import safe_open
    from synthetic import save_tiny_source

    import moecompress  # noqa: F401 - the plugin
    from moecompress.cli.main import app

    source = save_tiny_source("ergo", tmp_path / "source")
    common = ["--seq-len", "32", "--eval-tokens", "64"]
    pruned, quantized = tmp_path / "pruned", tmp_path / "quantized"
    for command, out, options in (
        ("prune", pruned, ["--keep", "4", "--scope", "layer", "--calib-tokens", "256"]),
        ("quantize", quantized, ["--scheme", "q6_k"]),
    ):
        result = CliRunner().invoke(app, [command, str(source), "--out", str(out), *common, *options])
        assert result.exit_code == 0, result.output
    report = json.loads((pruned / "moecompress_report.json").read_text())
    key = "layers.{}.feed_forward.expert_output_norm.scale"
    with (
        safe_open(source / "model.safetensors", "pt") as before,
        safe_open(pruned / "model.safetensors", "pt") as after,
    ):
        for layer, entry in report["layers"].items():
            kept = [e for e in range(8) if e not in entry["removed"]]
            torch.testing.assert_close(after.get_tensor(key.format(layer)), before.get_tensor(key.format(layer))[kept])

    ids = torch.randint(3, 380, (2, 24), generator=torch.Generator().manual_seed(0))
    model = load_stock(quantized)
    with torch.no_grad():
        want = load_stock(source)(input_ids=ids).logits
        close = (model(input_ids=ids).logits - want).abs().max()
        for layer in model.model.layers:
            norm = getattr(getattr(layer.mlp, "experts", None), "post_expert_norm", None)
            if norm is not None:
                assert type(layer.mlp.experts).__name__ == "QuantizedExperts"
                norm.weight.copy_(norm.weight.roll(1, dims=0))
        swapped = (model(input_ids=ids).logits - want).abs().max()
    assert swapped > 10 * close
