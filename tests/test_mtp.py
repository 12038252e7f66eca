"""Multi-token-prediction layers: Qwen3-Next's and Qwen3.5's top-level ``mtp.*`` module calibrated from what feeds it
(checked against a direct computation from the stock formulas), pruned like the main layers in the one-pass command
and in the pipeline, and MTP layers quantised like the others, with the output loading through the plugin."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from synthetic import save_tiny_model, save_tiny_source, tiny_tokenizer

from moecompress.checkpoint import CheckpointReader

QWEN_MTP = ("qwen3_next", "qwen3_5_moe")
MTP = "mtp.layers.0."


@pytest.fixture(scope="module")
def qwen_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_mtp")
    sources = {}
    for family in QWEN_MTP:
        sources[family] = save_tiny_source(family, root / family, seed=2)
    return sources


def _text_model(model):
    inner = model.model
    return getattr(inner, "language_model", inner)


def _stock(source):
    import transformers

    from moecompress.loading import load_adapter

    auto = getattr(transformers, load_adapter(source).auto_class)
    return auto.from_pretrained(source, dtype=torch.float32).eval()


def _mtp_layer(model, source):
    """The MTP decoder layer as the stock module: a copy of the full-attention main layer 1 with the stored
    ``mtp.layers.0.*`` weights (per-expert weights fused as transformers fuses them)."""
    text = _text_model(model)
    assert model.config.get_text_config().layer_types[1] == "full_attention"
    layer = copy.deepcopy(text.layers[1])
    reader = CheckpointReader(source)
    stored = {k[len(MTP) :]: v.float() for k, v in reader.read([k for k in reader.keys() if k.startswith(MTP)]).items()}
    experts = int(model.config.get_text_config().num_experts)
    if "mlp.experts.0.gate_proj.weight" in stored:
        stored["mlp.experts.gate_up_proj"] = torch.stack(
            [
                torch.cat(
                    [stored.pop(f"mlp.experts.{e}.gate_proj.weight"), stored.pop(f"mlp.experts.{e}.up_proj.weight")]
                )
                for e in range(experts)
            ]
        )
        stored["mlp.experts.down_proj"] = torch.stack(
            [stored.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(experts)]
        )
    layer.load_state_dict(stored, strict=True)
    return layer, reader


def _reference_moe_inputs(model, source, ids):
    """The MTP layer's MoE inputs at every position with a next token, from the stock formulas (vLLM's
    ``qwen3_next_mtp`` / ``qwen3_5_mtp``): h = the main model's output after its final norm;
    x_i = fc([pre_fc_norm_embedding(embed(t_{i+1})); pre_fc_norm_hidden(h_i)]) with Qwen's RMSNorm
    ``(1 + w) * x / rms(x)``; then the MTP decoder layer, called as the main model calls its full-attention layer
    on the window without its last token (causal: the same h and attention as on the full window)."""
    text = _text_model(model)
    layer, reader = _mtp_layer(model, source)
    eps = model.config.get_text_config().rms_norm_eps
    seen, recorded = {}, {}
    hooks = [
        text.norm.register_forward_hook(lambda m, a, o: seen.update(h=o)),
        text.layers[1].register_forward_pre_hook(lambda m, a, k: recorded.update(k), with_kwargs=True),
    ]

    def rms(x, weight):
        return (1.0 + weight.float()) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    captured = []
    hooks.append(layer.mlp.register_forward_hook(lambda m, a, o: captured.append(a[0].reshape(-1, a[0].shape[-1]))))
    with torch.no_grad():
        model(input_ids=ids[:, :-1], use_cache=False)
        embedded = F.embedding(ids[:, 1:], text.embed_tokens.weight)
        x = F.linear(
            torch.cat(
                [
                    rms(embedded, reader.tensor("mtp.pre_fc_norm_embedding.weight")),
                    rms(seen["h"], reader.tensor("mtp.pre_fc_norm_hidden.weight")),
                ],
                -1,
            ),
            reader.tensor("mtp.fc.weight").float(),
        )
        layer(x, **{k: v for k, v in recorded.items() if k not in ("hidden_states", "cache", "use_cache")})
    for hook in hooks:
        hook.remove()
    return captured[0]


@pytest.mark.parametrize("family", QWEN_MTP)
def test_qwen_mtp_capture_equals_the_stock_formulas(qwen_sources, family):
    from moecompress.sweep.engine import CalibrationSweep
    from moecompress.sweep.mtp import mtp_captures

    source = qwen_sources[family]
    ids = torch.randint(3, 384, (2, 16), generator=torch.Generator().manual_seed(7))
    batches = [{"input_ids": ids}]
    sweep = CalibrationSweep(source, batches, torch.zeros(ids.numel(), dtype=torch.long), ["all"], progress=False)
    for _ in sweep.run():
        pass
    (capture,) = list(mtp_captures(sweep, batches))
    assert capture.layer == 3 and capture.moe_input.shape == (2 * 15, 64)
    reference = _reference_moe_inputs(_stock(source), source, ids)
    torch.testing.assert_close(capture.moe_input, reference, rtol=0, atol=5e-5)


@pytest.mark.parametrize("family", QWEN_MTP)
def test_qwen_mtp_layer_is_pruned_from_its_calibration(qwen_sources, tmp_path, family):
    """prune --mtp keep: the MTP layer keeps as many experts as the main layers (what config.json says), its
    router rows and experts are the kept ones, and its choice is the top experts by routing frequency on the MoE
    inputs computed directly from the stock formulas on the same calibration windows."""
    from moecompress.calibration.model_inputs import calibration_batches
    from moecompress.loading import load_adapter
    from moecompress.passes.prune_experts import PruneExpertsConfig, prune_experts

    source = qwen_sources[family]
    config = PruneExpertsConfig(ratio=0.5, method="frequency")
    out = tmp_path / "pruned"
    report = prune_experts(source, out, config, calib_tokens=256, seq_len=64, progress=False)
    assert report["mtp"]["calibrated"] == [3]
    written = json.loads((out / "config.json").read_text())
    text = written.get("text_config", written)
    assert text["num_experts"] == 4 and text["mtp_num_hidden_layers"] == 1
    kept = text["moecompress"]["kept_experts"]
    assert all(len(kept[str(layer)]) == 4 for layer in range(4))
    assert report["layers"]["3"]["kept"] == kept["3"]

    batches, _, _ = calibration_batches(load_adapter(source), source, "builtin:prose", 256, 64, 8, config.seed, 224)
    model = _stock(source)
    before = CheckpointReader(source)
    router = before.tensor(f"{MTP}mlp.gate.weight").float()
    counts = torch.zeros(8)
    tokens = 0
    for batch in batches:
        inputs = _reference_moe_inputs(model, source, batch["input_ids"])
        chosen = torch.topk(torch.softmax(inputs @ router.T, -1), 2, dim=-1).indices
        counts += torch.bincount(chosen.reshape(-1), minlength=8)
        tokens += inputs.shape[0]
    frequency = counts / tokens
    torch.testing.assert_close(torch.tensor(report["layers"]["3"]["frequency"]), frequency, rtol=0, atol=1e-6)
    ranked = sorted(range(8), key=lambda e: (-float(frequency[e]), e))
    assert sorted(kept["3"]) == sorted(ranked[:4])
    assert float(frequency[ranked[3]]) > float(frequency[ranked[4]])

    after = CheckpointReader(out)
    assert torch.equal(after.tensor(f"{MTP}mlp.gate.weight"), before.tensor(f"{MTP}mlp.gate.weight")[kept["3"]])
    keys = [k for k in after.keys() if k.startswith(f"{MTP}mlp.experts.")]
    if family == "qwen3_5_moe":
        fused = before.tensor(f"{MTP}mlp.experts.gate_up_proj")
        assert torch.equal(after.tensor(f"{MTP}mlp.experts.gate_up_proj"), fused[kept["3"]])
    else:
        assert len(keys) == 4 * 3
        for new, old in enumerate(kept["3"]):
            assert torch.equal(
                after.tensor(f"{MTP}mlp.experts.{new}.down_proj.weight"),
                before.tensor(f"{MTP}mlp.experts.{old}.down_proj.weight"),
            )
    assert after.tensor("mtp.fc.weight").equal(before.tensor("mtp.fc.weight"))


def _cli(*args):
    from click.testing import CliRunner

    from moecompress.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _expert_keys(out, layer_prefix):
    stored = CheckpointReader(out, decode=False)
    return {
        k[len(layer_prefix) :]: v.dtype
        for k, v in stored.raw_tensors.items()
        if k.startswith(layer_prefix + "mlp.experts.")
    }


def test_quantize_of_qwen3_next_quantises_the_mtp_layer_and_evaluates(qwen_sources, tmp_path):
    """Default quantize (RTN mxfp4) with its default evaluation: the mtp.* layer's experts are quantised like the
    main layers', listed in quantization_config, and the plugin loads the output (it skips the MTP entries)."""
    import transformers

    import moecompress  # noqa: F401  (the plugin)

    out = tmp_path / "quantized"
    result = _cli("quantize", qwen_sources["qwen3_next"], "--out", out, "--seq-len", "64", "--eval-tokens", "512")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "moecompress_report.json").read_text())
    assert report["mtp"]["mtp_layers"] == [3] and report["eval"]["perplexity"] > 0
    modules = json.loads((out / "config.json").read_text())["quantization_config"]["modules"]
    assert f"{MTP}mlp.experts" in modules and "model.layers.1.mlp.experts" in modules
    main, mtp = _expert_keys(out, "model.layers.1."), _expert_keys(out, MTP)
    assert mtp == main and not any(dtype in ("BF16", "F32") for dtype in mtp.values())
    transformers.AutoModelForCausalLM.from_pretrained(out)


def test_gptq_and_low_rank_calibrate_the_mtp_layer_on_its_own_inputs(qwen_sources, tmp_path):
    """GPTQ and the low-rank allocation take the MTP layer's capture (the same as prune's): its experts get
    adapters from the shared budget and the report says it was calibrated."""
    out = tmp_path / "gptq"
    result = _cli(
        "quantize",
        qwen_sources["qwen3_next"],
        "--out",
        out,
        "--scheme",
        "int4",
        "--method",
        "gptq",
        "--lowrank-budget",
        "0.5",
        "--sensitivity",
        "none",
        "--calib-tokens",
        "512",
        "--seq-len",
        "64",
        "--no-eval",
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "moecompress_report.json").read_text())
    assert "calibrated" in report["mtp"]["written"]
    quantization = json.loads((out / "config.json").read_text())["quantization_config"]
    ranks = quantization["lowrank"][f"{MTP}mlp.experts"]
    assert sum(sum(per_expert) for per_expert in ranks.values()) > 0

    def quantised(prefix):
        return {k: v for k, v in _expert_keys(out, prefix).items() if ".lowrank." not in k}

    assert quantised(MTP) == quantised("model.layers.1.")


@pytest.mark.parametrize("family", QWEN_MTP)
def test_pipeline_prunes_and_quantises_the_qwen_mtp_layer(qwen_sources, tmp_path, family):
    """``moecompress run`` with prune and GPTQ in one stage: the mtp.* layer keeps as many experts as the main
    layers, quantised; the recipe's evaluation loads the output through the plugin."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "calibration: {source: builtin:prose, tokens: 512, seq_len: 64}\n"
        "passes:\n"
        "  - prune_experts: {ratio: 0.5}\n"
        "  - quantize: {scheme: int4, method: gptq}\n"
        "  - eval: {data: builtin:prose, tokens: 512}\n"
    )
    out = tmp_path / "out"
    result = _cli("run", recipe, "--model", qwen_sources[family], "--out", out)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    text = config.get("text_config", config)
    assert text["num_experts"] == 4 and len(text["moecompress"]["kept_experts"]["3"]) == 4
    assert f"{MTP}mlp.experts" in config["quantization_config"]["modules"]
    report = json.loads((out / "moecompress_report.json").read_text())
    assert report["previous_passes"][0]["mtp"]["calibrated"] == [3]
    prefix = "model.language_model.layers.1." if family == "qwen3_5_moe" else "model.layers.1."
    assert _expert_keys(out, MTP) == _expert_keys(out, prefix)
    stored = CheckpointReader(out, decode=False)
    assert stored.read_raw([f"{MTP}mlp.gate.weight"])[f"{MTP}mlp.gate.weight"].shape[0] == 4


def test_compressed_tensors_output_quantises_the_deepseek_mtp_layer_the_same_way(tmp_path):
    """--format compressed-tensors of a block-FP8 DeepSeek-V3 with an MTP layer: the MTP experts are stored like the
    main layers' (the expert targets are patterns that match them), and stock transformers loads the output."""
    import transformers
    from synthetic_quantized import add_mtp_layer, convert_to_block_fp8

    from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint

    bf16 = add_mtp_layer(save_tiny_model("deepseek_v3", tmp_path / "bf16", seed=3))
    fp8 = convert_to_block_fp8(bf16, tmp_path / "fp8")
    out = tmp_path / "ct"
    quantize_checkpoint(fp8, out, QuantizeConfig(scheme="int4", format="compressed-tensors"), progress=False)

    def stored(layer):
        return _expert_keys(out, f"model.layers.{layer}.")

    assert stored(3) == stored(2) and any(k.endswith("weight_packed") for k in stored(3))
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    transformers.AutoModelForCausalLM.from_pretrained(out)


def test_calibrated_quantize_refuses_an_mtp_layer_without_its_feed_before_work(tmp_path):
    """GPTQ needs the MTP layer's inputs; an MTP layer stored without enorm/hnorm/eh_proj cannot be calibrated:
    one line, exit 2, before any sweep (RTN and --mtp drop still work)."""
    from safetensors.torch import load_file, save_file
    from synthetic_quantized import add_mtp_layer

    from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint

    source = add_mtp_layer(save_tiny_model("deepseek_v3", tmp_path / "bf16", seed=3))
    tiny_tokenizer().save_pretrained(source)
    shard = source / "model.safetensors"
    tensors = load_file(shard)
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.3.enorm.")}, shard)
    from helpers import run_cli

    out = tmp_path / "gptq"
    result = run_cli("quantize", str(source), "--out", str(out), "--method", "gptq", "--seq-len", "64", "--no-eval")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "MTP layers [3] lack the norms and input projection that feed them" in line
    assert not (tmp_path / "gptq").exists()
    quantize_checkpoint(source, tmp_path / "rtn", QuantizeConfig(scheme="int4"), progress=False)
    assert (
        "model.layers.3.mlp.experts"
        in json.loads((tmp_path / "rtn" / "config.json").read_text())["quantization_config"]["modules"]
    )


def test_global_scope_ranks_the_qwen_mtp_layer_with_the_main_layers(qwen_sources, tmp_path):
    """--scope global: the MTP layer's experts are ranked with every main layer's; its count is recorded with the
    others, its stored experts and router rows match it, and the output evaluates through the plugin."""
    from moecompress.passes.prune_experts import PruneExpertsConfig, prune_experts

    source, out = qwen_sources["qwen3_next"], tmp_path / "global"
    report = prune_experts(
        source,
        out,
        PruneExpertsConfig(ratio=0.5, scope="global"),
        calib_tokens=256,
        seq_len=64,
        eval_data="builtin:prose",
        eval_tokens=256,
        progress=False,
    )
    assert report["experts_before"] == 4 * 8 and report["experts_after"] == 16
    section = json.loads((out / "config.json").read_text())["moecompress"]
    counts = section.get("experts_per_layer") or {str(layer): 4 for layer in range(4)}
    assert sum(counts.values()) == 16 and len(section["kept_experts"]["3"]) == counts["3"]
    after = CheckpointReader(out)
    assert after.tensor(f"{MTP}mlp.gate.weight").shape[0] == counts["3"]
    assert len([k for k in after.keys() if k.startswith(f"{MTP}mlp.experts.")]) == 3 * counts["3"]
    assert report["eval"]["perplexity"] > 0
