"""The quantisation pass end to end: native checkpoints load through the plugin and compute exactly what their
dequantised weights compute; gpt-oss exports load in stock transformers; GPTQ; footprint; refusals."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from helpers import load_stock, run_cli
from transformers import AutoModelForCausalLM

from moecompress.checkpoint import CheckpointReader
from moecompress.checkpoint.stream import group_keys_by_layer
from moecompress.families import adapter_for
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint
from moecompress.quantization.experts import quantize_experts_calibrated, quantize_experts_rtn, routed_tokens
from moecompress.quantization.gptq import gptq_quantize
from moecompress.quantization.scheme import QuantScheme


def _load(path):
    return load_stock(path)


def _ids(seed=0, vocab=380, length=24):
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


def _reference(source, scheme: QuantScheme, targets=("experts",)):
    """The source model with every targeted weight replaced by its RTN-dequantised value."""
    model = _load(source)
    with CheckpointReader(source) as reader:
        adapter = adapter_for(reader.config)
        layers, _ = group_keys_by_layer(reader, adapter)
        for layer, keys in layers.items():
            moe, rest, _ = adapter.split_layer(layer, reader.read(keys))
            module = adapter.decoder_layers(model)[layer]
            state = {}
            if moe is not None:
                quantized = quantize_experts_rtn(moe, scheme)
                state.update(adapter.runtime_moe_state(quantized.dequantized()))
            prefix = adapter.layer_prefix(layer)
            for key, tensor in rest.items():
                if key.endswith(".weight") and tensor.ndim == 2 and adapter.classify_key(key) in targets:
                    local = adapter.runtime_local_name(key[len(prefix) :])
                    state[local] = scheme.quantize(tensor).dequantize()
            module.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return model


@pytest.mark.parametrize(
    "family,scheme,targets",
    [
        ("qwen3_moe", QuantScheme("mxfp4"), ("experts",)),
        ("qwen3_moe", QuantScheme("int4", 32), ("experts", "attention")),
        ("mixtral", QuantScheme("int2", 32, symmetric=False), ("experts",)),
        ("qwen2_moe", QuantScheme("int4", 32, symmetric=False), ("experts", "shared_experts")),
        ("deepseek_v3", QuantScheme("mxfp4", scale_rule="ceil"), ("experts", "shared_experts", "attention")),
        ("gpt_oss", QuantScheme("mxfp4"), ("experts",)),
        ("olmoe", QuantScheme("int4", 32), ("experts",)),
        ("llama4", QuantScheme("int4", 32), ("experts", "shared_experts")),
    ],
)
def test_native_checkpoint_computes_what_its_dequantised_weights_compute(
    tiny_checkpoints, tmp_path, family, scheme, targets
):
    source = tiny_checkpoints[family]
    config = QuantizeConfig(
        scheme=scheme.name,
        group_size=scheme.group_size,
        symmetric=scheme.symmetric,
        scale_rule=scheme.scale_rule,
        targets=targets,
    )
    out = tmp_path / "q"
    quantize_checkpoint(source, out, config, progress=False)
    quantized = _load(out)
    adapter = adapter_for(json.loads((out / "config.json").read_text()))
    assert type(adapter.experts_of(quantized, adapter.moe_layers()[0])).__name__ == "QuantizedExperts"
    with torch.no_grad():
        expected = _reference(source, scheme, targets)(input_ids=_ids()).logits
        got = quantized(input_ids=_ids()).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_native_format_refuses_to_load_without_the_plugin(tiny_checkpoints, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(tiny_checkpoints["qwen3_moe"], out, QuantizeConfig(scheme="int4"), progress=False)
    code = f"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({str(out)!r})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "mismatch" in result.stderr.lower() or "ignore_mismatched_sizes" in result.stderr


def test_save_pretrained_round_trips_the_native_format(tiny_checkpoints, tmp_path):
    out = tmp_path / "q"
    quantize_checkpoint(tiny_checkpoints["deepseek_v3"], out, QuantizeConfig(scheme="int2"), progress=False)
    model = _load(out)
    model.save_pretrained(tmp_path / "saved")
    again = _load(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(again(input_ids=_ids()).logits, model(input_ids=_ids()).logits)
    with CheckpointReader(out) as first, CheckpointReader(tmp_path / "saved") as second:
        packed = [k for k in first.keys() if k.endswith("experts.gate_up_proj")]
        assert packed and all(torch.equal(first.tensor(k), second.tensor(k)) for k in packed)
    saved_config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved_config["quantization_config"]["quant_method"] == "moecompress"


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_gpt_oss_export_loads_in_stock_transformers_and_matches_native(tiny_checkpoints, tmp_path, rule):
    source = tiny_checkpoints["gpt_oss"]
    quantize_checkpoint(source, tmp_path / "native", QuantizeConfig(scale_rule=rule), progress=False)
    quantize_checkpoint(source, tmp_path / "export", QuantizeConfig(scale_rule=rule, format="gpt-oss"), progress=False)
    with CheckpointReader(tmp_path / "export", decode=False) as reader:
        assert any(k.endswith("gate_up_proj_blocks") for k in reader.keys())
        assert reader.config["quantization_config"]["quant_method"] == "mxfp4"
    code = (
        "import torch, sys; from transformers import AutoModelForCausalLM, Mxfp4Config;"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'export')!r}, dtype=torch.float32,"
        # with triton and `kernels` (transformers >= 5.25 installs it) the stock loader otherwise fetches a hub kernel
        " quantization_config=Mxfp4Config(dequantize=True));"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r});"
        f"torch.save(m(input_ids=ids).logits.detach(), {str(tmp_path / 'stock.pt')!r})"
    )
    torch.save(_ids(), tmp_path / "ids.pt")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    stock = torch.load(tmp_path / "stock.pt")
    with torch.no_grad():
        native = _load(tmp_path / "native")(input_ids=_ids()).logits
    torch.testing.assert_close(stock, native, atol=2e-5, rtol=1e-5)


def test_gptq_with_identity_hessian_is_rtn_and_beats_rtn_on_real_inputs():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(2, 32, 128, generator=g)
    inputs = torch.randn(2, 1024, 128, generator=g) @ torch.randn(128, 128, generator=g) * 0.3
    hessian = inputs.transpose(1, 2) @ inputs
    for scheme in (QuantScheme("mxfp4"), QuantScheme("int4"), QuantScheme("int2", symmetric=False)):
        rtn = scheme.quantize(weight)
        identity = gptq_quantize(weight, torch.eye(128).expand(2, 128, 128), scheme)
        assert torch.equal(identity.packed, rtn.packed) and torch.equal(identity.scales, rtn.scales)
        gptq = gptq_quantize(weight, hessian, scheme)

        def output_error(q):
            return ((inputs @ (q.dequantize() - weight).transpose(1, 2)) ** 2).sum()

        assert output_error(gptq) < 0.8 * output_error(rtn)


def test_gptq_uses_routed_tokens_and_falls_back_below_the_threshold(tiny_checkpoints):
    source = tiny_checkpoints["qwen3_moe"]
    with CheckpointReader(source) as reader:
        adapter = adapter_for(reader.config)
        layers, _ = group_keys_by_layer(reader, adapter)
        moe, _, _ = adapter.split_layer(0, reader.read(layers[0]))
    hidden = torch.randn(400, moe.gate_up.shape[-1], generator=torch.Generator().manual_seed(1))
    counts = [len(t) for t in routed_tokens(adapter, moe, hidden)]
    assert sum(counts) == 400 * adapter.top_k
    threshold = sorted(counts)[len(counts) // 2]
    scheme = QuantScheme("int4")
    result = quantize_experts_calibrated(adapter, moe, hidden, scheme, min_tokens=threshold)
    fallback = [eid for eid, n in zip(moe.expert_ids, counts, strict=True) if n < threshold]
    assert result.stats["rtn_fallback"] == fallback
    assert result.stats["tokens_per_expert"] == dict(zip(moe.expert_ids, counts, strict=True))
    rtn = quantize_experts_rtn(moe, scheme)
    for expert in fallback:
        assert torch.equal(result.gate_up[expert].packed, rtn.gate_up[expert].packed)
    used = next(e for e, n in enumerate(counts) if n >= threshold)
    assert not torch.equal(result.gate_up[used].packed, rtn.gate_up[used].packed)


def test_gptq_checkpoint_reports_fallbacks_and_propagates_quantised_outputs(tiny_with_tokenizer, tmp_path):
    source = tiny_with_tokenizer["qwen3_moe"]
    common = dict(scheme="int4", method="gptq")
    report = quantize_checkpoint(
        source, tmp_path / "a", QuantizeConfig(**common, gptq_min_tokens=10**9), calib_tokens=512, progress=False
    )
    assert all(len(v) == 8 for v in report["rtn_fallback_experts"].values())
    rtn = quantize_checkpoint(source, tmp_path / "b", QuantizeConfig(scheme="int4"), progress=False)
    assert rtn["footprint"] == report["footprint"]
    with CheckpointReader(tmp_path / "a") as a, CheckpointReader(tmp_path / "b") as b:
        assert all(torch.equal(a.tensor(k), b.tensor(k)) for k in a.keys())
    gptq = quantize_checkpoint(source, tmp_path / "c", QuantizeConfig(**common), calib_tokens=2048, progress=False)
    assert gptq["calibration"]["tokens"] == 2048
    assert gptq["layers"]["0"]["method"] == "gptq" and sum(gptq["layers"]["1"]["tokens_per_expert"].values()) > 0


@pytest.mark.parametrize(
    "scheme,group,symmetric,expected",
    [("mxfp4", 32, None, 4.25), ("int4", 32, None, 4.5), ("int4", 32, False, 4.75), ("int2", 32, None, 2.75)],
)
def test_footprint_counts_every_scale_and_zero_point(tiny_checkpoints, tmp_path, scheme, group, symmetric, expected):
    config = QuantizeConfig(scheme=scheme, group_size=group, symmetric=symmetric)
    report = quantize_checkpoint(tiny_checkpoints["qwen3_moe"], tmp_path / "q", config, progress=False)
    experts = report["footprint"]["classes"]["experts"]
    assert experts["bits_per_weight"] == expected
    assert experts["weights"] == report["source_footprint"]["classes"]["experts"]["weights"]
    assert report["footprint"]["classes"]["attention"] == report["source_footprint"]["classes"]["attention"]
    summary = json.loads(run_cli("inspect", str(tmp_path / "q"), "--json").stdout)
    assert summary["footprint"]["classes"]["experts"]["bits_per_weight"] == expected
    assert summary["parameters"]["experts"] == experts["weights"]


def test_quantize_cli_writes_and_reports(tiny_with_tokenizer, tmp_path):
    result = run_cli(
        "quantize", str(tiny_with_tokenizer["qwen3_moe"]), "--out", str(tmp_path / "q"), "--scheme", "w4a8",
        "--eval-tokens", "512", "--seq-len", "64",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "bits/weight" in result.stdout and "routing agreement" in result.stdout
    report = json.loads((tmp_path / "q" / "moecompress_report.json").read_text())
    assert report["scheme"]["name"] == "w4a8" and report["eval"]["routing_agreement"] > 0.5


@pytest.mark.parametrize(
    "args,message",
    [
        (["--format", "gpt-oss"], "GPT-OSS family"),
        (["--targets", "experts,router"], "targets"),
        (["--scheme", "int4", "--group-size", "128", "--targets", "experts,attention"], "group size"),
    ],
)
def test_quantize_refuses_what_it_cannot_do_in_one_line(tiny_checkpoints, tmp_path, args, message):
    result = run_cli("quantize", str(tiny_checkpoints["qwen3_moe"]), "--out", str(tmp_path / "q"), *args, "--no-eval")
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "q").exists()


def test_quantize_refuses_an_already_quantised_input(tiny_checkpoints, tmp_path):
    quantize_checkpoint(tiny_checkpoints["qwen3_moe"], tmp_path / "q", QuantizeConfig(), progress=False)
    result = run_cli("quantize", str(tmp_path / "q"), "--out", str(tmp_path / "qq"), "--no-eval")
    assert result.returncode == 2 and "already quantised" in result.stderr


def test_sweep_replacement_changes_what_later_layers_see(tiny_checkpoints):
    from moecompress.sweep.engine import CalibrationSweep

    source = tiny_checkpoints["qwen3_moe"]
    batches = [{"input_ids": _ids(3)}]
    tags = torch.zeros(2 * 24, dtype=torch.long)

    def layer1_input(replace_with_zero: bool):
        captures = CalibrationSweep(source, batches, tags, ["text"], progress=False).run()
        first = next(captures)
        if replace_with_zero:
            first.replacement = replace(first.moe, down=torch.zeros_like(first.moe.down))
        second = next(captures)
        captures.close()
        return second.moe_input

    assert not torch.allclose(layer1_input(True), layer1_input(False))
    assert torch.equal(layer1_input(False), layer1_input(False))


@pytest.mark.parametrize("scheme,symmetric", [("int4", True), ("int4", False), ("mxfp4", None), ("int2", None)])
def test_compressed_tensors_export_matches_native(tiny_checkpoints, tmp_path, scheme, symmetric):
    """Decompressed with compressed-tensors' own dequantiser (float32), the export computes what our native
    checkpoint computes; where stock transformers loads it directly, it matches to bf16 rounding of the weights."""
    from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer
    from safetensors.torch import load_file, save_file

    source = tiny_checkpoints["qwen3_moe"]
    config = QuantizeConfig(scheme=scheme, symmetric=symmetric)
    quantize_checkpoint(source, tmp_path / "native", config, progress=False)
    quantize_checkpoint(source, tmp_path / "ct", replace(config, format="compressed-tensors"), progress=False)
    with torch.no_grad():
        native = _load(tmp_path / "native")(input_ids=_ids()).logits
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    dense = CompressedTensorsDequantizer(tmp_path / "ct", dtype=torch.float32).process(tensors)
    (tmp_path / "dense").mkdir()
    save_file(dense, tmp_path / "dense" / "model.safetensors", metadata={"format": "pt"})
    plain_config = json.loads((tmp_path / "ct" / "config.json").read_text())
    del plain_config["quantization_config"]
    (tmp_path / "dense" / "config.json").write_text(json.dumps(plain_config))
    with torch.no_grad():
        decompressed = _load(tmp_path / "dense")(input_ids=_ids()).logits
    torch.testing.assert_close(decompressed, native, atol=2e-5, rtol=1e-5)
    if config.quant_scheme().symmetric:  # stock transformers drops asymmetric experts' zero points
        stock = AutoModelForCausalLM.from_pretrained(tmp_path / "ct").eval()
        for param in stock.parameters():
            param.data = param.data.float()
        with torch.no_grad():
            direct = stock(input_ids=_ids()).logits
        torch.testing.assert_close(direct, native, atol=2e-5 if scheme == "mxfp4" else 2e-2, rtol=0)


@pytest.mark.parametrize("salient_fraction", [0.0, 0.02])
def test_gptq_in_chunks_of_experts_gives_the_same_bytes_as_all_at_once(tiny_checkpoints, monkeypatch, salient_fraction):
    """GPTQ runs a few experts at a time (their Hessians, not the layer's, in memory); the chunks join into the
    tensor a single batch gives, salient weights included."""
    from moecompress.quantization import experts as experts_module

    source = tiny_checkpoints["qwen3_moe"]
    with CheckpointReader(source) as reader:
        adapter = adapter_for(reader.config)
        layers, _ = group_keys_by_layer(reader, adapter)
        moe, _, _ = adapter.split_layer(0, reader.read(layers[0]))
    assert moe.num_experts > 2
    hidden = torch.randn(400, moe.gate_up.shape[-1], generator=torch.Generator().manual_seed(2))
    scheme = QuantScheme("int4", salient_fraction=salient_fraction)
    results = {}
    for at_once in (moe.num_experts, 3):
        monkeypatch.setattr(experts_module, "GPTQ_EXPERTS_AT_ONCE", at_once)
        results[at_once] = quantize_experts_calibrated(adapter, moe, hidden, scheme, min_tokens=1)
    whole, chunked = results[moe.num_experts], results[3]
    for name in ("gate_up", "down"):
        a, b = getattr(whole, name), getattr(chunked, name)
        assert a.shape == b.shape
        assert torch.equal(a.packed, b.packed) and torch.equal(a.scales, b.scales)
        assert (a.zeros is None) == (b.zeros is None) and (a.zeros is None or torch.equal(a.zeros, b.zeros))
        if salient_fraction:
            assert a.salient.count > 0
            assert torch.equal(a.salient.positions, b.salient.positions)
            assert torch.equal(a.salient.values, b.salient.values)
