"""The binary scheme and salient weights: sign bits with least-squares group scales, salient weights chosen by
|w| x input RMS and kept exactly, their positions in a coded bitmap that the plugin decodes while loading."""

import json

import numpy as np
import pytest
import torch
from helpers import run_cli
from transformers import AutoModelForCausalLM

import moecompress  # noqa: F401  (registers the plugin)
from moecompress.checkpoint import CheckpointReader
from moecompress.evals.footprint import checkpoint_footprint
from moecompress.kernels import golomb_rice
from moecompress.kernels.packing import unpack_codes
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint
from moecompress.quantization import salient
from moecompress.quantization.gptq import gptq_quantize
from moecompress.quantization.scheme import QuantScheme


def _weight(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _keep(shape, fraction, seed=1):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < fraction


def test_binary_values_are_signs_times_the_mean_magnitude_of_the_non_salient_weights():
    weight, keep = _weight(3, 16, 256), _keep((3, 16, 256), 0.05)
    quantized = QuantScheme("binary", 128).quantize(weight, keep)
    assert quantized.packed.shape == (3, 16, 32) and quantized.scales.shape == (3, 16, 2)
    assert quantized.scales.dtype == torch.bfloat16
    dense = quantized.dequantize()
    assert torch.equal(dense[keep], weight[keep].to(torch.bfloat16).float())
    groups, kept = weight.reshape(3, 16, 2, 128), keep.reshape(3, 16, 2, 128)
    alpha = ((groups.abs() * ~kept).sum(-1) / (~kept).sum(-1)).to(torch.bfloat16).float()
    expected = torch.where(groups >= 0, alpha.unsqueeze(-1), -alpha.unsqueeze(-1)).reshape(weight.shape)
    assert torch.equal(dense[~keep], expected[~keep])
    plain = QuantScheme("binary", 128).quantize(weight)
    assert plain.salient is None and plain.nbytes * 8 / plain.numel == 1 + 16 / 128


def test_binary_scale_is_the_least_squares_one():
    weight = _weight(64, 128)
    quantized = QuantScheme("binary", 128).quantize(weight)
    error = (quantized.dequantize() - weight).pow(2).sum()
    for factor in (0.97, 1.03):
        scaled = quantized.dequantize() * factor
        assert (scaled - weight).pow(2).sum() > error


def test_salient_choice_follows_input_activation_norms():
    weight = torch.ones(2, 8, 32)
    weight[:, 3, 0] = 5.0  # large weight, quiet input
    scale = torch.ones(2, 32)
    scale[:, 7] = 100.0  # loud input column
    mask = salient.choose(weight, scale, 8 / (8 * 32))
    assert mask.sum() == 16
    assert mask[:, :, 7].all()
    assert not mask[:, 3, 0].any()
    rms = salient.input_rms([torch.full((4, 32), 2.0), torch.zeros(0, 32)], 32)
    assert torch.equal(rms[0], torch.full((32,), 2.0)) and torch.equal(rms[1], torch.ones(32))


@pytest.mark.parametrize("code", salient.BITMAP_CODES)
def test_salient_bitmap_round_trips_and_rejects_mismatches(code):
    length = 20_000
    positions = torch.unique(torch.randint(0, length, (300,), generator=torch.Generator().manual_seed(2)))
    stored = salient.encode_positions(positions, length, code)
    assert stored.dtype == torch.uint8
    assert torch.equal(salient.decode_positions(stored, length, positions.numel(), code), positions)
    if code == "raw":
        assert stored.numel() == length // 8
    else:
        assert stored.numel() < length // 8 / 4
    with pytest.raises(ValueError, match="stores"):
        salient.decode_positions(stored, length, positions.numel() + 1, code)
    with pytest.raises(ValueError):
        salient.decode_positions(stored, length + 8, positions.numel(), code)
    with pytest.raises(ValueError):
        salient.decode_positions(stored[: stored.numel() // 2], length, positions.numel(), code)


def test_expert_slices_carry_their_salient_weights():
    weight, keep = _weight(4, 8, 64), _keep((4, 8, 64), 0.1)
    quantized = QuantScheme("binary", 32).quantize(weight, keep)
    dense = quantized.dequantize()
    for expert in range(4):
        assert torch.equal(quantized[expert].dequantize(), dense[expert])
    index = torch.tensor([2, 0, 3])
    assert torch.equal(quantized.select(index).dequantize(), dense[index])
    with pytest.raises(ValueError, match="salient"):
        quantized.take_rows(torch.arange(4))


def test_gptq_keeps_salient_weights_exactly_and_is_rtn_with_an_identity_hessian():
    weight, keep = _weight(2, 16, 128), _keep((2, 16, 128), 0.05)
    scheme = QuantScheme("binary", 64)
    rtn = scheme.quantize(weight, keep)
    identity = gptq_quantize(weight, torch.eye(128).expand(2, 128, 128), scheme, keep=keep)
    assert torch.equal(identity.dequantize(), rtn.dequantize())
    x = _weight(512, 24, seed=3) @ _weight(24, 128, seed=4) + 0.1 * _weight(512, 128, seed=5)  # correlated inputs
    hessian = (x.T @ x).expand(2, 128, 128)
    gptq = gptq_quantize(weight, hessian, scheme, keep=keep)
    assert torch.equal(gptq.salient.positions, rtn.salient.positions)

    def output_error(quantized):
        return (torch.einsum("brc,tc->btr", quantized.dequantize() - weight, x)).pow(2).sum()

    assert output_error(gptq) < 0.8 * output_error(rtn)


def _quantize_binary(source, out, **options):
    config = QuantizeConfig(scheme="binary", group_size=32, salient_fraction=0.02, **options)
    return quantize_checkpoint(source, out, config, calib_tokens=1024, seq_len=64, progress=False)


def _independent_dense(out):
    """Every quantised expert tensor of ``out`` dequantised straight from the files (no plugin code)."""
    state = {}
    with CheckpointReader(out) as reader:
        quantization = reader.config["quantization_config"]
        for module in quantization["modules"]:
            for param in ("gate_up_proj", "down_proj"):
                key = f"{module}.{param}"
                signs = unpack_codes(reader.tensor(key), 1).float() * 2 - 1
                scales = reader.tensor(f"{key}_scales").float()
                dense = (signs.reshape(*scales.shape, -1) * scales.unsqueeze(-1)).reshape(signs.shape)
                bitmap = reader.tensor(f"{key}_salient").numpy().tobytes()
                positions = torch.from_numpy(golomb_rice.decode_indices(bitmap))
                dense.view(-1)[positions] = reader.tensor(f"{key}_salient_values").float()
                state[key] = dense
    return state


def test_binary_checkpoint_with_salient_weights_loads_through_the_plugin(tiny_with_tokenizer, tmp_path):
    source = tiny_with_tokenizer["qwen3_moe"]
    report = _quantize_binary(source, tmp_path / "golomb")
    config = json.loads((tmp_path / "golomb" / "config.json").read_text())["quantization_config"]
    assert config["schemes"]["default"]["salient_fraction"] == 0.02 and config["salient"]
    assert report["layers"]["0"]["salient_weights"]["gate_up"] > 0

    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    reference.load_state_dict(_independent_dense(tmp_path / "golomb"), strict=False)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "golomb", dtype=torch.float32).eval()
    with torch.no_grad():
        expected, got = reference(input_ids=ids).logits, loaded(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)

    loaded.save_pretrained(tmp_path / "saved")
    with CheckpointReader(tmp_path / "saved") as reader:
        assert not any(k.endswith("_positions") for k in reader.keys())
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, got)

    _quantize_binary(source, tmp_path / "raw", bitmap="raw")
    raw = AutoModelForCausalLM.from_pretrained(tmp_path / "raw", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(raw(input_ids=ids).logits, got)
    coded, plain = (checkpoint_footprint(tmp_path / d).classes["experts"] for d in ("golomb", "raw"))
    assert plain.bitmap_bytes == plain.bitmap_raw_bytes == coded.bitmap_raw_bytes == coded.weights // 8
    assert coded.bitmap_bytes < coded.bitmap_raw_bytes / 4
    assert coded.salient_value_bytes == plain.salient_value_bytes
    assert coded.salient_value_bytes / 2 == pytest.approx(0.02 * coded.weights, rel=0.01)  # bf16 values
    assert coded.bits_per_weight < plain.bits_per_weight == pytest.approx(coded.bits_per_weight_raw_bitmap)


def test_corrupt_salient_bitmap_fails_to_load_naming_the_tensor(tiny_with_tokenizer, tmp_path):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "q"
    _quantize_binary(tiny_with_tokenizer["qwen3_moe"], out)
    shard = next(out.glob("*.safetensors"))
    tensors = load_file(shard)
    key = next(k for k in tensors if k.endswith("down_proj_salient"))
    data = tensors[key].clone()
    data[40:] = torch.from_numpy(np.random.default_rng(0).integers(0, 256, data.numel() - 40, dtype=np.uint8))
    tensors[key] = data
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_salient"):
        AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--scheme", "binary", "--format", "compressed-tensors"], "binary"),
        (["--scheme", "int4", "--salient-fraction", "0.01", "--format", "compressed-tensors"], "native"),
        (["--scheme", "int4", "--group-size", "256"], "group size"),
    ],
)
def test_quantize_refuses_what_a_format_cannot_hold(tiny_checkpoints, tmp_path, args, message):
    result = run_cli("quantize", str(tiny_checkpoints["qwen3_moe"]), "--out", str(tmp_path / "q"), "--no-eval", *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "q").exists()
