"""Input decoders are classes registered by ``quant_method``: a decoder registered outside moecompress (here, from
this file) makes the reader present a release stored in its layout as bf16 weights, and a pass runs on it."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import run_cli
from safetensors.torch import load_file, save_file

import moecompress
from moecompress.checkpoint import CheckpointReader
from moecompress.checkpoint.decode import describe_input
from moecompress.checkpoint.decoders import INPUT_DECODERS, Encoded, InputDecoder, InputFormat, register, unregister

METHOD = "toy-int8-rows"


class ToyRows(InputDecoder):
    """``X.weight`` int8 codes with ``X.weight_row_scale`` float32 ``[rows]``: value = code x its row's scale."""

    quant_method = METHOD

    def plan(self, qconfig, shapes, dtype, read_small):
        encoded = {}
        for key, (shape, name) in shapes.items():
            if name == "I8":
                scale = f"{key}_row_scale"
                encoded[key] = Encoded({"codes": key, "scale": scale}, shape, lambda parts: _decode(parts, dtype))
        return InputFormat(METHOD, "int8 rows (toy)", encoded, frozenset())


def _decode(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return (parts["codes"].float() * parts["scale"][:, None]).to(dtype)


@pytest.fixture
def toy():
    register(ToyRows)
    yield
    unregister(METHOD)


def _toy_release(source: Path, directory: Path) -> dict[str, torch.Tensor]:
    """``source`` with its attention projections stored as int8 rows; returns their decoded values (in the
    checkpoint's dtype, which the reader decodes to)."""
    shutil.copytree(source, directory)
    state: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        state.update(load_file(path))
        path.unlink()
    for index in directory.glob("*.safetensors.index.json"):
        index.unlink()
    decoded = {}
    for key in [key for key in state if ".self_attn." in key and key.endswith("proj.weight")]:
        weight, dtype = state[key].float(), state[key].dtype
        scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127
        codes = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        state[key], state[f"{key}_row_scale"] = codes, scale
        decoded[key] = _decode({"codes": codes, "scale": scale}, dtype)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": METHOD}
    (directory / "config.json").write_text(json.dumps(config))
    return decoded


def test_a_decoder_registered_outside_moecompress_is_read_and_run_on(toy, tiny_checkpoints, tmp_path):
    release = tmp_path / "release"
    decoded = _toy_release(tiny_checkpoints["qwen3_moe"], release)
    assert decoded and METHOD in INPUT_DECODERS
    with CheckpointReader(release) as reader:
        assert not any(key.endswith("_row_scale") for key in reader.keys())
        for key, value in decoded.items():
            assert reader.dtype_of(key) == value.dtype
            assert torch.equal(reader.tensor(key), value), key
    assert describe_input(release)["format"] == METHOD

    out = tmp_path / "out"
    moecompress.quantize(release, out, evaluation=None)
    written = load_file(next(out.glob("*.safetensors")))
    assert all(torch.equal(written[key], value) for key, value in decoded.items())
    report = json.loads((out / "moecompress_report.json").read_text())
    assert METHOD in json.dumps(report)


def test_an_unregistered_layout_is_refused_in_one_line(toy, tiny_checkpoints, tmp_path):
    release = tmp_path / "release"
    _toy_release(tiny_checkpoints["qwen3_moe"], release)
    result = run_cli("quantize", str(release), "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert METHOD in result.stderr and "fp8, mxfp4, compressed-tensors" in result.stderr
