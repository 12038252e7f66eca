"""GPTQ on the GGML k-quant grid (issue #39): each block's fields are fitted when the sweep reaches the block, each
column is rounded against the values GGML decodes and its error spread. It beats the importance-weighted RTN on
correlated inputs, equals plain RTN with an identity Hessian, writes bytes gguf decodes to our values, and runs for
the experts end to end (the fallback widths of builtin:tiny-moe and a 256-wide checkpoint)."""

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from helpers import run_cli
from safetensors import safe_open
from synthetic import TINY_CONFIGS, auto_class_for, tiny_tokenizer

import moecompress
from moecompress.quantization.experts import input_importance
from moecompress.quantization.gptq import gptq_quantize
from moecompress.quantization.scheme import QuantizedTensor, QuantScheme
from moecompress.quantization.schemes.kquants import KQuant

KQUANTS = {"q2_k": "Q4_0", "q3_k": "Q4_0", "q4_k": "Q5_0", "q5_k": "Q5_1", "q6_k": "Q8_0"}


def _problem(cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights ``[2, 16, cols]`` and inputs ``[2, 2048, cols]`` whose columns are strongly correlated (a rank-32
    signal plus a little noise)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(2, 16, cols, generator=generator)
    latent = torch.randn(2, 2048, 32, generator=generator)
    inputs = latent @ torch.randn(32, cols, generator=generator) + 0.2 * torch.randn(2, 2048, cols, generator=generator)
    return weight, inputs


def _output_error(q: QuantizedTensor, weight: torch.Tensor, inputs: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(inputs @ (q.dequantize() - weight).transpose(1, 2)))


def _gguf_values(q: QuantizedTensor) -> np.ndarray:
    type_name, blocks = q.scheme.kind.ggml_blocks(q)
    return gguf_dequantize(blocks.numpy().reshape(-1), GGMLQuantizationType[type_name]).reshape(q.shape)


@pytest.mark.parametrize("name", list(KQUANTS))
@pytest.mark.parametrize("cols", [512, 96])
def test_gptq_beats_the_importance_weighted_rtn_on_correlated_inputs(name, cols):
    weight, inputs = _problem(cols)
    scheme = QuantScheme(name, 256)
    importance = input_importance(list(inputs), cols, [True, True])
    calibrated = scheme.quantize(weight, importance=importance)
    gptq = gptq_quantize(weight, inputs.transpose(1, 2) @ inputs, scheme)
    assert _output_error(gptq, weight, inputs) < 0.95 * _output_error(calibrated, weight, inputs)


@pytest.mark.parametrize("name", list(KQUANTS))
@pytest.mark.parametrize("cols", [512, 96])
def test_gptq_with_an_identity_hessian_is_plain_rtn_bit_for_bit(name, cols):
    weight, _ = _problem(cols, seed=1)
    weight[0, 0] = 0.0
    weight[1, 3, : cols // 2] = 0.25
    scheme = QuantScheme(name, 256)
    rtn = scheme.quantize(weight)
    identity = gptq_quantize(weight, torch.eye(cols).expand(2, cols, cols), scheme)
    assert torch.equal(identity.packed, rtn.packed) and torch.equal(identity.scales, rtn.scales)


@pytest.mark.parametrize("name", list(KQUANTS))
@pytest.mark.parametrize("cols", [512, 96])
def test_the_gguf_bytes_of_a_gptq_tensor_decode_to_our_values(name, cols):
    weight, inputs = _problem(cols, seed=2)
    q = gptq_quantize(weight, inputs.transpose(1, 2) @ inputs, QuantScheme(name, 256))
    assert q.scheme.kind.ggml_blocks(q)[0] == (name.upper() if cols % 256 == 0 else KQUANTS[name])
    ours = q.dequantize(torch.float32).numpy()
    assert np.array_equal(ours.view(np.uint32), _gguf_values(q).astype(np.float32).view(np.uint32))


def test_salient_weights_are_left_out_and_kept_exactly():
    weight, inputs = _problem(512, seed=3)
    keep = torch.zeros_like(weight, dtype=torch.bool)
    keep[:, :, ::37] = True
    q = gptq_quantize(weight, inputs.transpose(1, 2) @ inputs, QuantScheme("q3_k", 256), keep=keep)
    assert q.salient.count == int(keep.sum())
    dense = q.dequantize()
    codes_only = QuantizedTensor(q.scheme, q.shape, q.packed, q.scales).dequantize()
    assert torch.equal(dense[~keep], codes_only[~keep]) and not torch.equal(dense[keep], codes_only[keep])


def test_a_block_size_below_a_super_block_is_widened_to_one():
    weight, inputs = _problem(512, seed=4)
    hessian = inputs.transpose(1, 2) @ inputs
    scheme = QuantScheme("q4_k", 256)
    narrow, whole = gptq_quantize(weight, hessian, scheme, block_size=64), gptq_quantize(weight, hessian, scheme)
    assert torch.equal(narrow.packed, whole.packed) and torch.equal(narrow.scales, whole.scales)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        gptq_quantize(weight[..., :100], hessian[:, :100, :100], scheme)


def _expert_tensors(directory) -> dict[str, QuantizedTensor]:
    config = json.loads((directory / "config.json").read_text())
    scheme = QuantScheme.from_dict(next(iter(config["quantization_config"]["schemes"].values())))
    out = {}
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        names = [name for name in handle.keys() if name.endswith("experts.gate_up_proj")]
        for name in names:
            packed, scales = handle.get_tensor(name), handle.get_tensor(f"{name}_scales")
            cols = scheme.logical_cols(packed.shape[-1], scales.shape[-1])
            out[name] = QuantizedTensor(scheme, (*packed.shape[:-1], cols), packed, scales)
    return out


def test_cli_quantize_tiny_moe_q4_k_gptq_runs_gptq_on_the_fallback_blocks(tmp_path):
    out = tmp_path / "q4k"
    result = run_cli(
        "quantize", "builtin:tiny-moe", "--out", str(out), "--scheme", "q4_k", "--method", "gptq",
        "--calib-tokens", "4096", "--no-eval", "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((out / "moecompress_report.json").read_text())
    assert {stats["method"] for stats in report["layers"].values()} == {"gptq"}
    assert report["rtn_fallback_experts"] == {}
    experts = _expert_tensors(out)
    assert experts
    for q in experts.values():
        assert q.scheme.kind.ggml_blocks(q)[0] == "Q5_0"
        assert np.array_equal(q.dequantize().numpy(), _gguf_values(q).astype(np.float32))


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    """A random Qwen3-MoE whose every expert width is 256 (so the experts take GGML's own k-quant blocks)."""
    from transformers import AutoConfig

    kwargs = {**TINY_CONFIGS["qwen3_moe"], "hidden_size": 256, "moe_intermediate_size": 256, "num_experts": 4}
    kwargs["num_hidden_layers"] = 1
    config = AutoConfig.for_model(kwargs.pop("model_type"), **{**kwargs, "intermediate_size": 256, "head_dim": 16})
    torch.manual_seed(0)
    model = auto_class_for(config).from_config(config, dtype=torch.float32)
    directory = tmp_path_factory.mktemp("wide") / "qwen3_moe_256"
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def test_a_256_wide_checkpoint_takes_gptq_on_the_k_quant_blocks(wide_checkpoint, tmp_path, monkeypatch):
    calibration = {"tokens": 1024, "seq_len": 64}
    options = dict(scheme="q3_k", method="gptq", gptq_min_tokens=1, evaluation=None, calibration=calibration)
    moecompress.quantize(wide_checkpoint, tmp_path / "gptq", **options)
    monkeypatch.setattr(KQuant, "gptq", False)
    moecompress.quantize(wide_checkpoint, tmp_path / "rtn", **options)
    reports = {run: json.loads((tmp_path / run / "moecompress_report.json").read_text()) for run in ("gptq", "rtn")}
    assert {stats["method"] for stats in reports["gptq"]["layers"].values()} == {"gptq"}
    assert {stats["method"] for stats in reports["rtn"]["layers"].values()} == {"importance-weighted rtn"}
    gptq, rtn = _expert_tensors(tmp_path / "gptq"), _expert_tensors(tmp_path / "rtn")
    for name, q in gptq.items():
        assert q.scheme.kind.ggml_blocks(q)[0] == "Q3_K"
        assert np.array_equal(q.dequantize().numpy(), _gguf_values(q).astype(np.float32))
        assert not torch.equal(q.packed, rtn[name].packed)
