"""The compressed-tensors export against compressed-tensors' own (de)compressors and stock transformers.

Weights must dequantise bit-exactly to ``QuantizedTensor.dequantize()`` through compressed-tensors' decompressors;
whole checkpoints are checked through both load paths: compressed-tensors' model-free dequantiser (every scheme)
and ``AutoModelForCausalLM.from_pretrained`` (the schemes transformers 5.24 loads as MoE experts), logits against
the original model with its expert weights replaced by the dequantised ones.
"""

import contextlib
import json
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("compressed_tensors")

import synthetic
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.compressors.format import infer_module_format
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from compressed_tensors.utils.match import match_name
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

from moecompress.families import adapter_for, families_declaring
from moecompress.kernels import w4a8
from moecompress.quantization.experts import QuantizedMoE
from moecompress.quantization.formats import compressed_tensors as ctx
from moecompress.quantization.scheme import QuantScheme

SCHEMES = {
    "int4-sym-g32": QuantScheme("int4", 32, True),
    "int4-sym-g64": QuantScheme("int4", 64, True),
    "int4-asym-g32": QuantScheme("int4", 32, False),
    "int4-asym-g64": QuantScheme("int4", 64, False),
    "int2-sym-g32": QuantScheme("int2", 32, True),
    "int2-asym-g32": QuantScheme("int2", 32, False),
    "w4a8-sym-g32": QuantScheme("w4a8", 32, True),
    "mxfp4": QuantScheme("mxfp4"),
}
UNIT_SCHEMES = {
    **SCHEMES,
    "int4-sym-g128": QuantScheme("int4", 128, True),
    "int4-asym-g128": QuantScheme("int4", 128, False),
    "int2-asym-g128": QuantScheme("int2", 128, False),
    "w4a8-asym-g64": QuantScheme("w4a8", 64, False),
    "mxfp4-ceil": QuantScheme("mxfp4", scale_rule="ceil"),
}
# transformers 5.24's MoE expert dequantiser (integrations/compressed_tensors.py) reads weight_packed, weight_scale
# and weight_shape only: asymmetric experts lose their zero points and int-quantized (W4A8) experts have no
# weight_packed, so from_pretrained raises. These go through compressed-tensors' own dequantiser only.
TRANSFORMERS_CANNOT_LOAD = {"int4-asym-g32", "int4-asym-g64", "int2-asym-g32", "w4a8-sym-g32"}
FAMILIES = ("qwen3_moe", "mixtral")  # every scheme; DeepSeek-V3 (shared experts, a dense first layer) a few
CHECKPOINT_FAMILIES = (*FAMILIES, "deepseek_v3")
EXPERT_WIDTH = 64  # every expert matrix's input dim a multiple of 64, so group 64 applies to down_proj too


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A weight with varied group ranges, an all-zero group, a one-signed group and an outlier."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator) * torch.rand(rows, 1, generator=generator)
    weight[0, :32] = 0
    weight[1, :32] = weight[1, :32].abs()
    weight[2, 5] = 40.0
    return weight


def _local(tensors: dict[str, torch.Tensor], module: str) -> dict[str, torch.Tensor]:
    return {key.removeprefix(f"{module}."): value for key, value in tensors.items()}


def _scheme_group(scheme: QuantScheme):
    config = QuantizationConfig.model_validate(ctx.quantization_config(scheme, ["re:.*"], []))
    return config.config_groups["group_0"]


def _reference_dtype(scheme: QuantScheme, scale_dtype: torch.dtype) -> torch.dtype:
    """The dtype compressed-tensors dequantises in: the scale's (MXFP4 values are exact in any)."""
    return torch.float32 if scheme.is_float else scale_dtype


def _loaded_dtype(scheme: QuantScheme, scale_dtype: torch.dtype) -> torch.dtype:
    """The dtype compressed-tensors' decompressors return: the scale's (bf16 for MXFP4, whose scales are E8M0)."""
    return torch.bfloat16 if scheme.is_float else scale_dtype


# ---- one linear -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16], ids=["bf16-scales"])
@pytest.mark.parametrize("name", list(UNIT_SCHEMES))
def test_linear_decompresses_bit_exactly(name, scale_dtype):
    scheme = UNIT_SCHEMES[name]
    rows, cols = 44, 256  # 44 rows: the packed zero points end in a partial word
    q = scheme.quantize(_weight(rows, cols))
    tensors = ctx.linear_tensors("model.layers.3.mlp.experts.5.down_proj.weight", q, scale_dtype)
    local = _local(tensors, "model.layers.3.mlp.experts.5.down_proj")
    groups = cols // scheme.group_size

    layout = {key: (tuple(value.shape), value.dtype) for key, value in local.items()}
    if scheme.is_float:
        assert layout == {
            "weight_packed": ((rows, cols // 2), torch.uint8),
            "weight_scale": ((rows, cols // 32), torch.uint8),
        }
        assert torch.equal(local["weight_packed"], q.packed) and torch.equal(local["weight_scale"], q.scales)
    elif scheme.activation_bits:
        expected = {"weight": ((rows, cols), torch.int8), "weight_scale": ((rows, groups), scale_dtype)}
        if not scheme.symmetric:
            expected["weight_zero_point"] = ((rows, groups), torch.int8)
        assert layout == expected
    else:
        expected = {
            "weight_packed": ((rows, cols * scheme.bits // 32), torch.int32),
            "weight_scale": ((rows, groups), scale_dtype),
            "weight_shape": ((2,), torch.int64),
        }
        if not scheme.symmetric:
            expected["weight_zero_point"] = ((-(-rows * scheme.bits // 32), groups), torch.int32)
        assert layout == expected
        assert local["weight_shape"].tolist() == [rows, cols]

    group = _scheme_group(scheme)
    assert infer_module_format(torch.nn.Linear, group) == group.format == ctx.compression_format(scheme)
    compressor = BaseCompressor.get_value_from_registry(group.format)
    assert set(local) == set(compressor.compression_param_names(group))
    dense = compressor.decompress(local, group)["weight"]
    reference = q.dequantize(_reference_dtype(scheme, scale_dtype))
    assert dense.dtype == _loaded_dtype(scheme, scale_dtype)
    assert torch.equal(dense.to(reference.dtype), reference)


@pytest.mark.parametrize("name", [n for n, s in UNIT_SCHEMES.items() if not s.is_float])
def test_integer_layout_matches_compressed_tensors_compressor(name):
    """Compressing our dequantised weight with our scales and zero points gives our tensors back."""
    scheme = UNIT_SCHEMES[name]
    q = scheme.quantize(_weight(44, 256, seed=1))
    local = _local(ctx.linear_tensors("m.weight", q, torch.float32), "m")
    offset = 2 ** (scheme.bits - 1)
    signed_codes = (q.codes().to(torch.int16) - offset).to(torch.int8)
    state = {"weight": q.dequantize(), "weight_scale": q.scales.float()}
    if q.zeros is not None:
        state["weight_zero_point"] = (q.zeros.to(torch.int16) - offset).to(torch.int8)
    group = _scheme_group(scheme)
    compressed = BaseCompressor.get_value_from_registry(group.format).compress(state, group)
    assert set(compressed) == set(local)
    for key, value in local.items():
        assert torch.equal(compressed[key], value), key
    if not scheme.activation_bits:
        assert torch.equal(local["weight_packed"], pack_to_int32(signed_codes, scheme.bits))


def test_linear_tensors_refuses_non_weights():
    q = QuantScheme("int4").quantize(torch.randn(8, 64))
    with pytest.raises(ValueError, match=r"must end in '\.weight'"):
        ctx.linear_tensors("model.lm_head", q)
    with pytest.raises(ValueError, match="2-D"):
        ctx.linear_tensors("x.weight", QuantScheme("int4").quantize(torch.randn(2, 8, 64)))


# ---- config -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantization_config_is_valid(name):
    scheme = SCHEMES[name]
    assert ctx.supports(scheme) is None
    raw = ctx.quantization_config(scheme, ["re:.*experts.*"], ["lm_head"])
    assert raw["quant_method"] == "compressed-tensors" and raw["quantization_status"] == "compressed"
    hf_config = CompressedTensorsConfig.from_dict({"quantization_config": raw})
    assert hf_config.is_quantization_compressed
    group = hf_config.quantization_config.config_groups["group_0"]
    weights = group.weights
    assert (weights.num_bits, weights.group_size, weights.strategy) == (scheme.bits, scheme.group_size, "group")
    assert weights.type == ("float" if scheme.is_float else "int")
    assert weights.symmetric == (scheme.is_float or scheme.symmetric)
    if scheme.activation_bits:
        inputs = group.input_activations
        assert (inputs.num_bits, inputs.type, inputs.strategy, inputs.dynamic, inputs.symmetric) == (
            8,
            "int",
            "token",
            True,
            True,
        )
    else:
        assert group.input_activations is None
    assert json.loads(json.dumps(raw)) == raw


@pytest.mark.parametrize("family", families_declaring("per_expert_linears"))
def test_expert_targets_match_expert_linears_only(family):
    adapter = adapter_for(synthetic.TINY_CONFIGS[family])
    (target,) = ctx.expert_targets(adapter)
    layer = adapter.moe_layers()[0]
    for which in range(3):
        assert match_name(adapter._expert_key(layer, 7, which).removesuffix(".weight"), target)
    experts = f"{adapter.layer_prefix(layer)}{adapter.moe_disk_prefix}experts"
    for proj in ("gate_proj", "up_proj", "down_proj"):  # the names vLLM looks a fused MoE layer's scheme up by
        assert match_name(f"{experts}.0.{proj}", target)
    others = [
        f"{adapter.layer_prefix(layer)}self_attn.q_proj",
        f"{adapter.layer_prefix(layer)}{adapter.moe_disk_prefix}{adapter.router_key}",
        f"{adapter.layer_prefix(layer)}mlp.shared_expert.gate_proj",
        f"{adapter.layer_prefix(layer)}mlp.shared_experts.down_proj",
        "lm_head",
    ]
    assert not any(match_name(name, target) for name in others)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_vl_moe"])
def test_fused_expert_families_are_refused(family):
    adapter = adapter_for(synthetic.TINY_CONFIGS[family])
    scheme = QuantScheme("int4")
    q = scheme.quantize(torch.randn(2, 64, 64))
    assert "fused" in ctx.unsupported(adapter, scheme, ("experts",))
    with pytest.raises(ValueError, match="per-expert"):
        ctx.expert_tensors(adapter, 0, q, q)


# ---- W4A8 activations ---------------------------------------------------------------------------------------
_TOKEN_INT8 = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)


def _ct_activation_fake_quant(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' dynamic per-token int8 fake quantisation of ``x`` ``[tokens, K]`` (given a batch dim:
    with a 2-D input its "token" strategy reduces over the whole tensor, see the test below)."""
    batched = x.unsqueeze(0)
    scale, zero_point = compute_dynamic_scales_and_zp(value=batched, args=_TOKEN_INT8, module=None)
    return fake_quantize(batched, scale, zero_point, _TOKEN_INT8).squeeze(0)


def test_activation_rounding_differs_from_ours():
    """compressed-tensors' reference (fake) quantiser scales a token by ``amax / 127.5`` onto -128..127 (the largest
    value then clips to 127); ours by ``amax / 127`` onto -127..127."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=generator) * torch.rand(64, 1, generator=generator) * 4
    amax = x.abs().amax(dim=-1, keepdim=True)
    ct_scale = amax / 127.5
    ct_rule = torch.round(torch.clamp(x / ct_scale, -128, 127)) * ct_scale
    assert torch.equal(_ct_activation_fake_quant(x), ct_rule)
    ours = w4a8.fake_quantize_activations(x)
    assert not torch.equal(ours, ct_rule)
    step = amax / 127
    assert ((ours - ct_rule).abs() <= step).all()  # at most one of our steps apart
    # compressed-tensors' token strategy keeps dims 0 and 1: a 2-D [tokens, K] input gets ONE scale
    scale, _ = compute_dynamic_scales_and_zp(value=x, args=_TOKEN_INT8, module=None)
    assert scale.numel() == 1


# ---- whole checkpoints --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct_source")
    out = {}
    for family in CHECKPOINT_FAMILIES:
        config = dict(synthetic.TINY_CONFIGS[family])
        config["intermediate_size" if family == "mixtral" else "moe_intermediate_size"] = EXPERT_WIDTH
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(synthetic.TINY_CONFIGS, family, config)
            out[family] = synthetic.save_tiny_model(family, root / family)
    return out


def _read(directory) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((directory / "config.json").read_text()), load_file(directory / "model.safetensors")


def _write(directory, config: dict, tensors: dict[str, torch.Tensor]):
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _is_attention_projection(key: str, tensor: torch.Tensor) -> bool:
    return ".self_attn." in key and key.endswith("_proj.weight") and tensor.ndim == 2


ATTENTION_TARGET = r"re:.*\.self_attn\.(q|k|v|o)_proj$"


def _export(source, out, scheme: QuantScheme, scale_dtype: torch.dtype, attention: bool = False):
    """Write the compressed-tensors checkpoint of ``source`` with RTN-quantised routed experts (and, with
    ``attention``, attention projections).

    Returns it, the dense tensors it should decompress to, the dequantised canonical experts by layer and the
    dequantised attention weights by key.
    """
    config, tensors = _read(source)
    adapter = adapter_for(config)
    ct_tensors: dict[str, torch.Tensor] = {}
    dense = dict(tensors)
    experts, linears = {}, {}
    layer_keys: dict[int, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer = adapter.layer_of_key(key)
        if layer is None:
            ct_tensors[key] = tensor
        else:
            layer_keys.setdefault(layer, {})[key] = tensor
    dtype = _reference_dtype(scheme, scale_dtype)
    for layer, layer_tensors in sorted(layer_keys.items()):
        moe, rest, _ = adapter.split_layer(layer, layer_tensors)
        for key, tensor in list(rest.items()):
            if attention and _is_attention_projection(key, tensor):
                rest[key] = scheme.quantize(tensor)
                linears[key] = dense[key] = rest[key].dequantize(dtype).float()
        quantized = None
        if moe is not None:
            quantized = QuantizedMoE(moe, scheme.quantize(moe.gate_up), scheme.quantize(moe.down))
            gate_up = quantized.gate_up.dequantize(dtype).float()
            down = quantized.down.dequantize(dtype).float()
            experts[layer] = (gate_up, down)
            inter = moe.intermediate_size
            for expert in range(moe.num_experts):
                dense[adapter._expert_key(layer, expert, 0)] = gate_up[expert, :inter]
                dense[adapter._expert_key(layer, expert, 1)] = gate_up[expert, inter:]
                dense[adapter._expert_key(layer, expert, 2)] = down[expert]
        ct_tensors.update(ctx.layer_tensors(adapter, layer, quantized, rest, scale_dtype))
    targets = ctx.expert_targets(adapter) + ([ATTENTION_TARGET] if attention else [])
    config["quantization_config"] = ctx.quantization_config(scheme, targets, [])
    return _write(out, config, ct_tensors), dense, experts, linears


def _token_ids() -> torch.Tensor:
    return torch.randint(3, 384, (2, 12), generator=torch.Generator().manual_seed(0))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_token_ids()).logits.float()


def _reference_model(source, experts, linears=None, dtype=torch.float32):
    """The original model with its routed experts (and ``linears``) replaced by the dequantised weights."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).eval()
    adapter = adapter_for(model.config.to_dict())
    with torch.no_grad():
        for layer, (gate_up, down) in experts.items():
            adapter.experts_of(model, layer).gate_up_proj.copy_(gate_up)
            adapter.experts_of(model, layer).down_proj.copy_(down)
        for key, weight in (linears or {}).items():
            model.get_parameter(key).copy_(weight)
    return model


def _experts_forward(act):
    """transformers 5's eager experts loop with ``act`` applied to both expert matmuls' inputs."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        for expert in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
            if expert == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert])
            gate, up = torch.nn.functional.linear(act(hidden_states[token_idx]), self.gate_up_proj[expert]).chunk(2, -1)
            hidden = torch.nn.functional.linear(act(self.act_fn(gate) * up), self.down_proj[expert])
            out.index_add_(0, token_idx, (hidden * top_k_weights[token_idx, top_k_pos, None]).to(out.dtype))
        return out

    return forward


@contextlib.contextmanager
def _activation_quant(model, act):
    adapter = adapter_for(model.config.to_dict())
    experts = [adapter.experts_of(model, layer) for layer in adapter.moe_layers()]
    for module in experts:
        module.forward = types.MethodType(_experts_forward(act), module)
    try:
        yield
    finally:
        for module in experts:
            del module.forward


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]):
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


CASES = [(family, name, torch.bfloat16) for family in FAMILIES for name in SCHEMES] + [
    *[("deepseek_v3", name, torch.bfloat16) for name in ("int4-sym-g32", "int4-asym-g32", "w4a8-sym-g32", "mxfp4")],
]


@pytest.mark.parametrize(("family", "name", "scale_dtype"), CASES, ids=[f"{f}-{n}-{str(d)[6:]}" for f, n, d in CASES])
def test_checkpoint_round_trip(checkpoints, tmp_path, family, name, scale_dtype):
    scheme = SCHEMES[name]
    source = checkpoints[family]
    ct_dir, dense, dequantized, _ = _export(source, tmp_path / "ct", scheme, scale_dtype)
    reference = _reference_model(source, dequantized)
    want = _logits(reference)

    # compressed-tensors' model-free dequantiser: every tensor bit-exact, then stock transformers on the result
    _, ct_tensors = _read(ct_dir)
    decompressed = CompressedTensorsDequantizer(ct_dir, dtype=torch.float32).process(ct_tensors)
    _assert_same_tensors(decompressed, dense)
    config, _ = _read(source)
    dense_model = AutoModelForCausalLM.from_pretrained(_write(tmp_path / "dense", config, decompressed)).eval()
    torch.testing.assert_close(_logits(dense_model), want, atol=1e-5, rtol=0)

    # stock transformers on the compressed checkpoint
    if name in TRANSFORMERS_CANNOT_LOAD:  # if this starts loading, move the scheme out of the set
        with pytest.raises((RuntimeError, AssertionError)):
            AutoModelForCausalLM.from_pretrained(ct_dir)
        return
    model = AutoModelForCausalLM.from_pretrained(ct_dir).eval()
    adapter = adapter_for(config)
    for layer, (gate_up, down) in dequantized.items():
        experts = adapter.experts_of(model, layer)
        # transformers keeps the dequantised experts in the dtype compressed-tensors computed them in (the scale's;
        # bf16 for MXFP4), not the model's float32, and its grouped_mm experts then run in that dtype
        assert experts.gate_up_proj.dtype == experts.down_proj.dtype == _loaded_dtype(scheme, scale_dtype)
        assert torch.equal(experts.gate_up_proj.float(), gate_up) and torch.equal(experts.down_proj.float(), down)
    for param in model.parameters():  # (`model.float()` is refused for a quantised model)
        param.data = param.data.float()
    torch.testing.assert_close(_logits(model), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["int4-sym-g32", "int2-sym-g32", "mxfp4"])
def test_bf16_model_loads_the_reference(checkpoints, tmp_path, name):
    """In the serving dtype (bf16 model, bf16 scales) stock transformers computes exactly the reference."""
    scheme = SCHEMES[name]
    source = checkpoints["qwen3_moe"]
    ct_dir, _, experts, _ = _export(source, tmp_path / "ct", scheme, torch.bfloat16)
    reference = _reference_model(source, experts, dtype=torch.bfloat16)  # exact copies: the values are bf16's
    model = AutoModelForCausalLM.from_pretrained(ct_dir, dtype=torch.bfloat16).eval()
    torch.testing.assert_close(_logits(model), _logits(reference), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_w4a8_activation_rounding_in_the_model(checkpoints, tmp_path, family):
    """The W4A8 reference with our int8 activation step differs from the weight-only one and, slightly, from the
    same model with compressed-tensors' activation rounding (neither stock loader applies it to MoE experts)."""
    scheme = SCHEMES["w4a8-sym-g32"]
    _, _, experts, _ = _export(checkpoints[family], tmp_path / "ct", scheme, torch.bfloat16)
    model = _reference_model(checkpoints[family], experts)
    weight_only = _logits(model)
    with _activation_quant(model, lambda x: x):
        torch.testing.assert_close(_logits(model), weight_only, atol=1e-5, rtol=0)  # the patched loop is faithful
    with _activation_quant(model, w4a8.fake_quantize_activations):
        ours = _logits(model)
    with _activation_quant(model, _ct_activation_fake_quant):
        theirs = _logits(model)
    activation_effect = (ours - weight_only).abs().max().item()
    rounding_gap = (ours - theirs).abs().max().item()  # about 0.15 on logits of magnitude up to 6.5 here
    assert activation_effect > 1e-4
    assert 0 < rounding_gap < activation_effect * 2


@pytest.mark.parametrize("name", ["int4-sym-g32", "int4-asym-g32", "int2-sym-g32", "w4a8-sym-g32", "mxfp4"])
def test_attention_projections_too(checkpoints, tmp_path, name):
    """Dense linears (the attention projections) next to the experts, one config group for both."""
    scheme = SCHEMES[name]
    source = checkpoints["qwen3_moe"]
    ct_dir, dense, experts, linears = _export(source, tmp_path / "ct", scheme, torch.bfloat16, attention=True)
    assert len(linears) == 8
    _, ct_tensors = _read(ct_dir)
    decompressed = CompressedTensorsDequantizer(ct_dir, dtype=torch.float32).process(ct_tensors)
    _assert_same_tensors(decompressed, dense)
    if name in TRANSFORMERS_CANNOT_LOAD:
        return
    # compressed-tensors decompresses dense integer linears in the model's dtype (a float32 model would skip the
    # bf16 rounding that defines our integer weights) and MXFP4 ones in bf16: compare in the serving dtype, bf16
    dtype = torch.bfloat16
    reference = _reference_model(source, experts, linears, dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(ct_dir, dtype=dtype).eval()
    torch.testing.assert_close(_logits(model), _logits(reference), atol=1e-5, rtol=0)
    for key, weight in linears.items():  # decompressed by the first forward
        assert torch.equal(model.get_parameter(key).float(), weight), key
