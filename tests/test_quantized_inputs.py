"""Quantised hub releases as input: decoded on read to what stock transformers / compressed-tensors produce,
pruned in their own format, quantised from their decoded values; moecompress's native output refused."""

import json

import pytest
import torch
from safetensors.torch import save_file

from moecompress.checkpoint import CheckpointReader
from moecompress.checkpoint.decode import dequantize_block_fp8, unpack_int32_codes
from moecompress.synthetic import TINY_CONFIGS, save_tiny_model
from moecompress.synthetic_quantized import add_mtp_layer, convert_to_block_fp8, quantize_block_fp8


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
