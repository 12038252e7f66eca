"""GGML k-quants (q2_k .. q6_k) as schemes: our quantise then dequantise equals gguf's dequantisation of the GGML
bytes we would write, bit for bit; widths that are not a multiple of 256 take llama.cpp's fallback block type;
calibration weights the fit; a checkpoint quantised with one loads through the plugin."""

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from helpers import load_stock

import moecompress
from moecompress.quantization.scheme import QuantScheme
from moecompress.quantization.schemes.ggml_blocks import FORMATS, fields_of

KQUANTS = {"q2_k": "Q4_0", "q3_k": "Q4_0", "q4_k": "Q5_0", "q5_k": "Q5_1", "q6_k": "Q8_0"}
"""Each k-quant's fallback for widths not a multiple of 256: llama.cpp's llama_tensor_get_type."""


def _weights(cols: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(2, 6, cols, generator=generator) * torch.rand(2, 6, 1, generator=generator)
    weight[0, 0] = 0.0
    weight[0, 1, : cols // 2] = 0.25
    weight[1, 2] = -weight[1, 2].abs()
    return weight


def _gguf_values(q) -> np.ndarray:
    type_name, blocks = q.scheme.kind.ggml_blocks(q)
    return gguf_dequantize(blocks.numpy().reshape(-1), GGMLQuantizationType[type_name]).reshape(q.shape)


@pytest.mark.parametrize("name", list(KQUANTS))
@pytest.mark.parametrize("cols", [512, 96])
def test_our_dequantisation_is_ggufs_of_the_bytes_we_write(name, cols):
    scheme = QuantScheme(name, 256)
    q = scheme.quantize(_weights(cols))
    assert q.scheme.kind.ggml_blocks(q)[0] == (name.upper() if cols % 256 == 0 else KQUANTS[name])
    ours = q.dequantize(torch.float32).numpy()
    assert np.array_equal(ours.view(np.uint32), _gguf_values(q).astype(np.float32).view(np.uint32))
    error = np.linalg.norm(ours - _weights(cols).numpy()) / np.linalg.norm(_weights(cols).numpy())
    assert error < {"q2_k": 0.35, "q3_k": 0.2}.get(name, 0.1)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_our_decoder_reads_any_block_as_gguf_does(fmt):
    """Random bytes (fp16 fields made finite) decode the same both ways: the decoder is checked on its own."""
    layout = FORMATS[fmt]
    generator = torch.Generator().manual_seed(1)
    quants = torch.randint(0, 256, (40, layout.part_bytes("q")), generator=generator, dtype=torch.uint8)
    scales = torch.randint(0, 256, (40, layout.part_bytes("s")), generator=generator, dtype=torch.uint8)
    fields = fields_of(layout, quants, scales)
    for name, _, _ in layout.fields:
        if name in ("d", "dmin", "m"):
            finite = torch.rand(40, generator=generator).to(torch.float16).view(torch.uint8).reshape(40, 2)
            fields[name].copy_(finite)
    ours = layout.decode(fields).numpy()
    blocks = torch.cat([fields[name] for name, _, _ in layout.fields], dim=1).numpy()
    expected = gguf_dequantize(blocks.reshape(-1), GGMLQuantizationType[fmt]).reshape(40, -1)
    assert np.array_equal(ours.view(np.uint32), expected.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("name", list(KQUANTS))
def test_a_width_not_a_multiple_of_32_is_refused(name):
    scheme = QuantScheme(name, 256)
    assert "F16" in scheme.width_problem(100) and scheme.width_problem(96) is None
    with pytest.raises(ValueError, match="not a multiple of 32"):
        scheme.quantize(torch.randn(4, 100))


@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q3_k"])
def test_importance_weights_the_fit(name):
    scheme = QuantScheme(name, 256)
    weight = _weights(512, seed=3)
    importance = torch.ones(2, 1, 512)
    importance[..., ::7] = 50.0

    def weighted_error(q) -> float:
        return float((importance * (q.dequantize() - weight) ** 2).sum())

    assert weighted_error(scheme.quantize(weight, importance=importance)) < weighted_error(scheme.quantize(weight))


def test_a_kquant_checkpoint_loads_through_the_plugin(tiny_with_tokenizer, tmp_path):
    source, out = tiny_with_tokenizer["qwen3_moe"], tmp_path / "q4k"
    result = moecompress.quantize(
        source, out, scheme="q4_k", method="gptq", evaluation=None, calibration={"tokens": 512, "seq_len": 64}
    )
    assert result.scheme.startswith("q4_k")
    config = json.loads((out / "config.json").read_text())
    model = load_stock(out)
    adapter = moecompress.families.adapter_for(config)
    experts = adapter.experts_of(model, adapter.moe_layers()[0])
    assert type(experts).__name__ == "QuantizedExperts" and experts.scheme.name == "q4_k"
    weight = experts.quantized(
        "gate_up_proj", (experts.num_experts, 2 * experts.intermediate_size, experts.hidden_size)
    )
    assert weight.scheme.kind.ggml_blocks(weight)[0] == "Q5_0"
    assert np.array_equal(weight.dequantize().numpy(), _gguf_values(weight).astype(np.float32))
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
