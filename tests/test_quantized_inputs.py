"""Quantised hub releases as input: decoded on read to what stock transformers / compressed-tensors produce,
pruned in their own format, quantised from their decoded values; moecompress's native output refused."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file
from synthetic import TINY_CONFIGS, save_tiny_model
from synthetic_quantized import add_mtp_layer, convert_to_block_fp8, quantize_block_fp8

from moecompress.checkpoint import CheckpointReader
from moecompress.checkpoint.decoders.compressed_tensors import unpack_int32_codes
from moecompress.checkpoint.decoders.fp8 import dequantize_block_fp8


def _tiny_deepseek(root, name, seed=0, **overrides):
    saved = dict(TINY_CONFIGS["deepseek_v3"])
    TINY_CONFIGS["deepseek_v3"].update(overrides)
    try:
        return save_tiny_model("deepseek_v3", root / name, seed=seed)
    finally:
        TINY_CONFIGS["deepseek_v3"].clear()
        TINY_CONFIGS["deepseek_v3"].update(saved)


@pytest.fixture(scope="module")
def fp8_deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 with an MTP layer, in bf16 and as a block-FP8 release (all dims below 128, so that
    stock transformers' CPU dequantisation, which derives the block from the grid, is right too)."""
    root = tmp_path_factory.mktemp("fp8")
    bf16 = add_mtp_layer(_tiny_deepseek(root, "bf16"))
    return bf16, convert_to_block_fp8(bf16, root / "fp8")


def test_block_fp8_decodes_as_stock_transformers(fp8_deepseek):
    import transformers

    _, fp8 = fp8_deepseek
    reader = CheckpointReader(fp8)
    assert reader.input_format.name == "fp8"
    assert not any(key.endswith("_scale_inv") for key in reader.tensors)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv" in reader.raw_tensors
    stock = transformers.AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.bfloat16).state_dict()
    compared = 0
    for key in reader.tensors:
        if key in stock and reader.raw_tensors.get(key, reader.tensors[key]).dtype == "F8_E4M3":
            assert torch.equal(reader.tensor(key), stock[key]), key
            compared += 1
    assert compared >= 10
    fused = stock["model.layers.2.mlp.experts.gate_up_proj"]
    for expert in range(fused.shape[0]):
        gate = reader.tensor(f"model.layers.2.mlp.experts.{expert}.gate_proj.weight")
        up = reader.tensor(f"model.layers.2.mlp.experts.{expert}.up_proj.weight")
        assert torch.equal(fused[expert], torch.cat([gate, up]))


def test_block_fp8_partial_blocks_use_the_block_of_each_element():
    """Dims that are not multiples of the block: element (i, j) takes scale [i // 128, j // 128] (DeepSeek's
    ``weight_dequant``, vLLM); stock transformers 5.25 instead divides the dim by the grid (here 200 / 2 = 100)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 300, generator=generator)
    codes, scale = quantize_block_fp8(weight, (128, 128))
    assert scale.shape == (2, 3)
    decoded = dequantize_block_fp8(codes, scale, (128, 128), torch.float32)
    rows = torch.arange(200)[:, None] // 128
    cols = torch.arange(300)[None, :] // 128
    assert torch.equal(decoded, codes.float() * scale[rows, cols])
    assert (decoded - weight).abs().max() < 0.07 * weight.abs().max()


def test_gpt_oss_mxfp4_decodes_as_stock_transformers(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 24, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(118, 134, (3, 24, 2), dtype=torch.uint8, generator=generator)
    save_file(
        {
            "model.layers.0.mlp.experts.gate_up_proj_blocks": blocks,
            "model.layers.0.mlp.experts.gate_up_proj_scales": scales,
        },
        tmp_path / "model.safetensors",
    )
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}})
    )
    reader = CheckpointReader(tmp_path)
    assert list(reader.tensors) == ["model.layers.0.mlp.experts.gate_up_proj"]
    decoded = reader.tensor("model.layers.0.mlp.experts.gate_up_proj")
    assert decoded.shape == (3, 64, 24) and decoded.dtype == torch.bfloat16
    assert torch.equal(decoded, convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [4, 2, 8])
def test_pack_quantized_decodes_as_compressed_tensors(tmp_path, symmetric, bits):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group", group_size=32)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    generator = torch.Generator().manual_seed(bits)
    rows, cols = 40, 96
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = torch.randint(low, high + 1, (rows, cols), generator=generator)
    scale = (torch.rand(rows, cols // 32, generator=generator) * 0.01 + 0.001).to(torch.bfloat16)
    zero = None if symmetric else torch.randint(low, high + 1, (rows, cols // 32), generator=generator).to(torch.int8)
    state = {"weight": codes.to(torch.bfloat16), "weight_scale": scale}
    if zero is not None:
        state["weight_zero_point"] = zero
    state["weight"] = (codes - (0 if zero is None else zero.repeat_interleave(32, 1))).to(
        torch.bfloat16
    ) * scale.repeat_interleave(32, 1)
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    expected = PackedQuantizationCompressor.decompress(dict(compressed), scheme)["weight"]
    prefix = "model.layers.0.mlp.experts.0.gate_proj."
    save_file({prefix + k: v.contiguous() for k, v in compressed.items()}, tmp_path / "model.safetensors")
    config = {
        "model_type": "deepseek_v3",
        "dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": args.model_dump(), "format": "pack-quantized"}
            },
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    reader = CheckpointReader(tmp_path)
    assert list(reader.tensors) == [prefix + "weight"]
    assert torch.equal(reader.tensor(prefix + "weight"), expected.to(torch.bfloat16))


def test_unpack_int32_codes_order():
    words = torch.tensor([[0x76543210, 0x0FEDCBA9 - (1 << 32) + (1 << 32)]], dtype=torch.int64).to(torch.int32)
    codes = unpack_int32_codes(words, 4, 16) + 8
    assert codes[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 0]


# ---- prune and quantize of quantised releases --------------------------------------------------------------
ARGS = ["--calib-tokens", "512", "--seq-len", "64", "--eval-tokens", "512"]


def _cli(*args):
    from click.testing import CliRunner

    from moecompress.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def _stored(directory) -> dict[str, torch.Tensor]:
    return CheckpointReader(directory, decode=False).read_raw(CheckpointReader(directory, decode=False).keys())


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """Tiny releases in their hub layouts, each with a tokenizer: block-FP8 DeepSeek-V3 with an MTP layer and an
    expert width of 160 (two 128-blocks, the second partial), gpt-oss MXFP4, compressed-tensors INT4 g32
    (symmetric, experts only: Kimi-K2-Thinking's scheme) DeepSeek-V3."""
    from synthetic import tiny_tokenizer

    from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint

    root = tmp_path_factory.mktemp("releases")
    tokenizer = tiny_tokenizer()
    bf16 = add_mtp_layer(_tiny_deepseek(root, "ds_bf16", seed=3, moe_intermediate_size=160))
    tokenizer.save_pretrained(bf16)
    fp8 = convert_to_block_fp8(bf16, root / "ds_fp8")
    small = add_mtp_layer(_tiny_deepseek(root, "ds_small_bf16", seed=6))
    tokenizer.save_pretrained(small)
    fp8_small = convert_to_block_fp8(small, root / "ds_fp8_small")
    plain = _tiny_deepseek(root, "ds_plain", seed=4)
    tokenizer.save_pretrained(plain)
    ct = root / "ds_ct_int4"
    quantize_checkpoint(
        plain,
        ct,
        QuantizeConfig(scheme="int4", group_size=32, symmetric=True, format="compressed-tensors"),
        progress=False,
    )
    oss_bf16 = save_tiny_model("gpt_oss", root / "oss_bf16", seed=5)
    tokenizer.save_pretrained(oss_bf16)
    oss = root / "oss_mxfp4"
    quantize_checkpoint(oss_bf16, oss, QuantizeConfig(scheme="mxfp4", format="gpt-oss"), progress=False)
    return {"bf16": bf16, "fp8": fp8, "fp8_small": fp8_small, "ct": ct, "oss": oss}


def _stock(directory, masked=None):
    """The stock transformers model of ``directory`` in float32, with the experts ``masked`` ({layer: ids})
    excluded from routing (a -inf router bias or correction bias)."""
    import transformers

    kwargs = {}
    if (
        json.loads((directory / "config.json").read_text()).get("quantization_config", {}).get("quant_method")
        == "mxfp4"
    ):
        kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs).eval()
    for layer, ids in (masked or {}).items():
        router = model.model.layers[layer].mlp
        router = getattr(router, "gate", None) or router.router
        bias = router.e_score_correction_bias if hasattr(router, "e_score_correction_bias") else router.bias
        with torch.no_grad():
            bias[ids] = float("-inf")
    return model


def _logits(model) -> torch.Tensor:
    ids = torch.randint(3, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("name", ["fp8", "ct", "oss"])
def test_prune_keeps_the_release_format_and_masked_logits(releases, tmp_path, name):
    source, out = releases[name], tmp_path / "pruned"
    result = _cli("prune", source, "--out", out, "--ratio", "0.5", "--method", "frequency", *ARGS)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "moecompress_report.json").read_text())
    assert report["input_format"]["format"] == {"fp8": "fp8", "ct": "compressed-tensors", "oss": "mxfp4"}[name]
    source_config = json.loads((source / "config.json").read_text())
    out_config = json.loads((out / "config.json").read_text())
    assert out_config["quantization_config"] == source_config["quantization_config"]
    before, after = _stored(source), _stored(out)
    kept = {int(layer): entry["kept"] for layer, entry in report["layers"].items()}
    if name == "fp8":
        kept[3] = report["mtp"]["kept"]["3"]
        assert len(kept[3]) == len(kept[1])
    checked = 0
    for key, tensor in after.items():
        layer = key.split(".")[2] if key.startswith("model.layers.") else None
        routed = any(part in key for part in (".experts.", ".mlp.gate.", ".mlp.router."))
        if layer is None or int(layer) not in kept or not routed:
            assert torch.equal(tensor.view(torch.uint8), before[key].view(torch.uint8)), key
            continue
        ids = kept[int(layer)]
        parts = key.split(".")
        if parts[5].isdigit():  # per-expert tensors: expert j of the output is expert ids[j] of the input
            parts[5] = str(ids[int(parts[5])])
            original = before[".".join(parts)]
        else:  # fused experts and router rows
            original = before[key][ids]
        assert tensor.dtype == original.dtype and torch.equal(tensor.view(torch.uint8), original.view(torch.uint8))
        checked += 1
    assert checked > 0 and set(after) <= set(before) | {k for k in after if k not in before and "experts" in k}
    main = json.loads((source / "config.json").read_text())["num_hidden_layers"]
    removed = {int(layer): entry["removed"] for layer, entry in report["layers"].items() if int(layer) < main}
    torch.testing.assert_close(_logits(_stock(out)), _logits(_stock(source, removed)), rtol=0, atol=1e-5)


def test_prune_drops_the_mtp_layer_on_request(releases, tmp_path):
    out = tmp_path / "pruned"
    result = _cli("prune", releases["fp8"], "--out", out, "--ratio", "0.5", "--mtp", "drop", *ARGS)
    assert result.exit_code == 0, result.output
    assert not any(key.startswith("model.layers.3.") for key in CheckpointReader(out, decode=False).keys())
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0


@pytest.mark.parametrize("name", ["fp8_small", "oss", "ct"])
def test_quantize_of_a_release_equals_quantize_of_its_stock_dequantised_copy(releases, tmp_path, name):
    """Byte-identical outputs (the compressed-tensors copy made by compressed-tensors' dequantiser, as
    transformers cannot save the model it loads from it). The FP8 release has every dim below 128: with a partial
    block after a full one (the 160-wide experts of ``fp8``) stock transformers 5.25 derives the block as
    dim / grid (80) and its copy differs from DeepSeek's definition, which the reader follows (test above)."""
    from safetensors.torch import load_file

    from moecompress.checkpoint.decode import target_dtype

    stock_copy = tmp_path / "stock_bf16"
    config = json.loads((releases[name] / "config.json").read_text())
    if name == "ct":  # transformers cannot save a compressed-tensors model it loaded: compressed-tensors' own copy
        from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer

        tensors = load_file(releases[name] / "model.safetensors")
        dense = CompressedTensorsDequantizer(releases[name], dtype=target_dtype(config)).process(tensors)
        stock_copy.mkdir()
        save_file(dense, stock_copy / "model.safetensors", metadata={"format": "pt"})
        config.pop("quantization_config")
        (stock_copy / "config.json").write_text(json.dumps(config))
    else:
        _stock(releases[name]).to(target_dtype(config)).save_pretrained(stock_copy)
    for path in releases[name].glob("tokenizer*"):
        (stock_copy / path.name).write_bytes(path.read_bytes())
    config = json.loads((stock_copy / "config.json").read_text())
    assert "quantization_config" not in config
    outputs = {}
    for label, source in (("release", releases[name]), ("copy", stock_copy)):
        outputs[label] = tmp_path / label
        result = _cli(
            "quantize",
            source,
            "--out",
            outputs[label],
            "--scheme",
            "int4",
            "--mtp",
            "drop",
            "--no-eval",
        )
        assert result.exit_code == 0, result.output
    release, copy = _stored(outputs["release"]), _stored(outputs["copy"])
    assert set(release) == set(copy)
    for key in release:
        assert torch.equal(release[key].view(torch.uint8), copy[key].view(torch.uint8)), key
    report = json.loads((outputs["release"] / "moecompress_report.json").read_text())
    assert report["input_format"]["format"] == {"fp8_small": "fp8", "oss": "mxfp4", "ct": "compressed-tensors"}[name]
    quantization = [json.loads((outputs[k] / "config.json").read_text())["quantization_config"] for k in outputs]
    assert quantization[0] == quantization[1]


def test_default_quantize_with_evaluation_quantises_the_mtp_layer(releases, tmp_path):
    """The MTP layer's experts are quantised like the main layers' and listed in quantization_config; the plugin
    skips those entries (transformers builds no MTP layer), so the default evaluation loads the output, while a
    main-model module the model lacks is still refused."""
    import transformers

    import moecompress  # noqa: F401  (the plugin)

    out = tmp_path / "quantized"
    result = _cli("quantize", releases["fp8"], "--out", out, "--seq-len", "64", "--eval-tokens", "512")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "moecompress_report.json").read_text())
    assert report["mtp"]["mode"] == "keep" and report["eval"]["perplexity"] > 0
    assert set(report["layers"]) == {"1", "2", "3"}
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    modules = config["quantization_config"]["modules"]
    assert "model.layers.3.mlp.experts" in modules and "model.layers.2.mlp.experts" in modules
    stored = CheckpointReader(out, decode=False)
    suffixes = {
        layer: {
            k.split(".mlp.experts.")[1]: v.dtype
            for k, v in stored.raw_tensors.items()
            if f"layers.{layer}.mlp.experts." in k
        }
        for layer in (2, 3)
    }
    assert suffixes[3] == suffixes[2] and not any(dtype in ("BF16", "F8_E4M3") for dtype in suffixes[3].values())
    transformers.AutoModelForCausalLM.from_pretrained(out)
    config["quantization_config"]["modules"]["model.layers.7.mlp.experts"] = "default"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape("names 'model.layers.7.mlp.experts', which this model lacks")):
        transformers.AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.parametrize("command", ["prune", "quantize"])
def test_native_output_as_input_is_one_line_exit_2(releases, tmp_path, command):
    from helpers import run_cli

    native = tmp_path / "native"
    made = _cli("quantize", releases["bf16"], "--out", native, "--scheme", "int4", "--no-eval")
    assert made.exit_code == 0, made.output
    args = ARGS if command == "prune" else ARGS[2:]  # plain rtn reads no calibration: --calib-tokens is refused
    result = run_cli(command, str(native), "--out", str(tmp_path / "again"), *args)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("moecompress: error: ")
    assert line.endswith(f"{native}: already quantised by moecompress (native format); use the original checkpoint")


# ---- hub downloads ---------------------------------------------------------------------------------------
def _fetched(patterns, files):
    from huggingface_hub.utils import filter_repo_objects

    allow, ignore = patterns
    return sorted(filter_repo_objects(files, allow_patterns=allow, ignore_patterns=ignore))


def test_hub_download_fetches_only_what_the_model_loads():
    from moecompress.checkpoint.resolve import hub_patterns

    mistral = [
        "config.json",
        "consolidated.safetensors",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "params.json",
        "tokenizer.json",
        "tokenizer.model",
    ]
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    assert _fetched(hub_patterns(index), mistral) == sorted(set(mistral) - {"consolidated.safetensors"})
    gpt_oss = [
        "chat_template.jinja",
        "config.json",
        "metal/model.bin",
        "model-00000-of-00002.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "original/config.json",
        "original/model--00001-of-00002.safetensors",
        "tokenizer.json",
    ]
    index = {"weight_map": {"a": "model-00000-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}}
    assert _fetched(hub_patterns(index), gpt_oss) == [
        "chat_template.jinja",
        "config.json",
        "model-00000-of-00002.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    single = ["config.json", "model.safetensors", "pytorch_model.bin", "onnx/model.safetensors"]
    assert _fetched(hub_patterns({}), single) == ["config.json", "model.safetensors"]
    # the index unreadable (offline, not cached): every top-level safetensors but Mistral's consolidated copy
    assert _fetched(hub_patterns(None), [*mistral, "original/x.safetensors"]) == sorted(
        set(mistral) - {"consolidated.safetensors"}
    )


@pytest.mark.parametrize("mtp", ["keep", "drop"])
def test_pipeline_prune_and_quantize_of_an_fp8_release_with_mtp(releases, tmp_path, mtp):
    """Prune and quantize in one layer pipeline: the MTP layer pruned and quantised like the others (keep), or
    gone (drop); the plugin loads the output for the recipe's evaluation."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "calibration: {source: builtin:prose, tokens: 512, seq_len: 64}\n"
        "passes:\n"
        f"  - prune_experts: {{ratio: 0.5, mtp: {mtp}}}\n"
        f"  - quantize: {{scheme: mxfp4, mtp: {mtp}}}\n"
        "  - eval: {data: builtin:prose, tokens: 512}\n"
    )
    out = tmp_path / "out"
    result = _cli("run", recipe, "--model", releases["fp8"], "--out", out)
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert ("model.layers.3.mlp.experts" in config["quantization_config"]["modules"]) == (mtp == "keep")
    mtp_keys = [k for k in CheckpointReader(out, decode=False).keys() if k.startswith("model.layers.3.")]
    if mtp == "drop":
        assert config["num_nextn_predict_layers"] == 0 and not mtp_keys
        return
    assert config["num_nextn_predict_layers"] == 1
    kept = config["moecompress"]["kept_experts"]
    assert len(kept["3"]) == len(kept["1"]) == 4
    prune_report = json.loads((out / "moecompress_report.json").read_text())["previous_passes"][0]
    assert prune_report["mtp"]["calibrated"] == [3]
    stored = CheckpointReader(out, decode=False)
    experts = {
        layer: sorted(k.split(".experts.")[1] for k in stored.keys() if f"layers.{layer}.mlp.experts." in k)
        for layer in (1, 3)
    }
    assert experts[3] == experts[1] and "gate_up_proj" in experts[3]
    assert (
        stored.read_raw(["model.layers.3.mlp.experts.gate_up_proj"])["model.layers.3.mlp.experts.gate_up_proj"].shape[0]
        == 4
    )


def test_mtp_calibration_sees_the_mtp_modules_moe_inputs(releases):
    """The MTP layer's captured MoE inputs equal a direct computation from the stock model: the main model's
    output h_i (after its final norm, what vLLM's and SGLang's drafters receive) and token i+1's embedding through
    enorm/hnorm/eh_proj, then the MTP layer's attention (built from its stored weights), at every position but
    the last."""
    import copy

    import torch.nn.functional as F
    import transformers

    from moecompress.sweep.engine import CalibrationSweep
    from moecompress.sweep.mtp import mtp_captures

    source = releases["bf16"]
    ids = torch.randint(3, 384, (2, 16), generator=torch.Generator().manual_seed(7))
    batches = [{"input_ids": ids}]
    sweep = CalibrationSweep(source, batches, torch.zeros(ids.numel(), dtype=torch.long), ["all"], progress=False)
    for _ in sweep.run():
        pass
    (capture,) = list(mtp_captures(sweep, batches))
    assert capture.layer == 3 and capture.moe_input.shape == (2 * 15, 64) and capture.tags.shape == (30,)

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    last = {}
    model.model.norm.register_forward_hook(lambda m, a, o: last.update(h=o))
    stored = CheckpointReader(source)
    mtp = {k[len("model.layers.3.") :]: v.float() for k, v in stored.read(stored.keys()).items() if ".3." in k[:16]}
    layer = copy.deepcopy(model.model.layers[2])
    experts = range(8)
    weights = {
        k: v for k, v in mtp.items() if k.split(".")[0] in ("self_attn", "input_layernorm", "post_attention_layernorm")
    }
    weights.update({k: v for k, v in mtp.items() if k.startswith(("mlp.shared_experts.", "mlp.gate."))})
    weights["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([mtp[f"mlp.experts.{e}.gate_proj.weight"], mtp[f"mlp.experts.{e}.up_proj.weight"]]) for e in experts]
    )
    weights["mlp.experts.down_proj"] = torch.stack([mtp[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
    layer.load_state_dict(weights, strict=True)
    seen = []
    layer.mlp.register_forward_hook(lambda m, a, o: seen.append(a[0].reshape(-1, a[0].shape[-1])))

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + model.config.rms_norm_eps))

    with torch.no_grad():
        model(input_ids=ids)
        h = last["h"][:, :-1]
        embedded = F.embedding(ids[:, 1:], mtp["embed_tokens.weight"])
        x = F.linear(
            torch.cat([rms(embedded, mtp["enorm.weight"]), rms(h, mtp["hnorm.weight"])], -1), mtp["eh_proj.weight"]
        )
        positions = torch.arange(15)[None]
        layer(x, position_embeddings=model.model.rotary_emb(x, positions), position_ids=positions, attention_mask=None)
    torch.testing.assert_close(capture.moe_input, seen[0], rtol=0, atol=2e-5)


def test_mtp_layer_is_pruned_by_its_own_calibration(releases, tmp_path):
    out = tmp_path / "pruned"
    result = _cli("prune", releases["fp8"], "--out", out, "--ratio", "0.5", "--method", "frequency", *ARGS)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "moecompress_report.json").read_text())
    assert report["mtp"]["calibrated"] == [3] and "uncalibrated_rule" not in report["mtp"]
    scores = report["layers"]["3"]
    assert sum(scores["frequency"]) == pytest.approx(2.0, abs=1e-4)  # top-2 of 8 over the MTP tokens
    assert sorted(scores["kept"]) == scores["kept"] and len(scores["kept"]) == 4


def test_top_level_mtp_module_is_dropped_on_request(tmp_path):
    """Qwen3-Next / Qwen3.5 ship their MTP module as top-level ``mtp.*`` tensors: --mtp drop leaves them out."""
    from synthetic import save_tiny_source

    from moecompress.passes.prune_experts import PruneExpertsConfig, prune_experts
    from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint

    source = save_tiny_source("qwen3_next", tmp_path / "source")
    assert any(key.startswith("mtp.") for key in CheckpointReader(source).keys())
    prune_experts(
        source, tmp_path / "p", PruneExpertsConfig(ratio=0.5, mtp="drop"), calib_tokens=256, seq_len=64, progress=False
    )
    quantize_checkpoint(source, tmp_path / "q", QuantizeConfig(scheme="mxfp4", mtp="drop"), progress=False)
    for out in (tmp_path / "p", tmp_path / "q"):
        assert not any(key.startswith("mtp.") for key in CheckpointReader(out, decode=False).keys())
        config = json.loads((out / "config.json").read_text())
        assert config.get("mtp_num_hidden_layers", config.get("text_config", {}).get("mtp_num_hidden_layers")) == 0
