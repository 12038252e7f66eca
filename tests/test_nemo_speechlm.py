"""Nemotron 3.5 Transcribe (``nemo_speechlm``): the Nemotron-H language model under ``llm.`` calibrated text-only, its
speech towers passed through; ``save_pretrained``'s per-expert layout and the NeMo export's fused, transposed experts
(``gate_and_up_projs``/``down_projs``) with ``mixer._fp32_params``."""

import json

import pytest
import torch
from helpers import checkpoint_adapter, load_stock, token_batches
from safetensors.torch import load_file, save_file
from synthetic import save_tiny_source, tiny_tokenizer

from moecompress.checkpoint import CheckpointReader
from moecompress.checkpoint.stream import group_keys_by_layer
from moecompress.families import adapter_for
from moecompress.sweep.engine import CalibrationSweep

FAMILY = "nemo_speechlm"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = save_tiny_source(FAMILY, tmp_path_factory.mktemp(FAMILY) / "source")
    return directory


@pytest.fixture(scope="module")
def nemo_export(checkpoint, tmp_path_factory):
    """The tiny checkpoint in the NeMo export's layout: per layer ``mixer.experts.gate_and_up_projs`` ``[E, H, I]``,
    ``down_projs`` ``[E, I, H]``, the Mamba-2 float32 parameters under ``mixer._fp32_params.``."""
    directory = tmp_path_factory.mktemp("nemo_export")
    tensors = load_file(checkpoint / "model.safetensors")
    adapter = adapter_for(json.loads((checkpoint / "config.json").read_text()))
    out = {}
    for key, tensor in tensors.items():
        for name in ("A_log", "D", "dt_bias"):
            if key.endswith(f".mixer.{name}"):
                key = key.replace(f".mixer.{name}", f".mixer._fp32_params.{name}")
        if ".mixer.experts." not in key:
            out[key] = tensor
    for layer in adapter.moe_layers():
        prefix = f"{adapter.layer_prefix(layer)}mixer.experts."
        count = adapter.experts_in_layer(layer)
        up = torch.stack([tensors[f"{prefix}{e}.up_proj.weight"] for e in range(count)])
        down = torch.stack([tensors[f"{prefix}{e}.down_proj.weight"] for e in range(count)])
        out[f"{prefix}gate_and_up_projs"] = up.transpose(1, 2).contiguous()
        out[f"{prefix}down_projs"] = down.transpose(1, 2).contiguous()
    save_file(out, directory / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        (directory / name).write_bytes((checkpoint / name).read_bytes())
    tiny_tokenizer().save_pretrained(directory)
    return directory


def test_text_only_sweep_equals_the_stock_model(checkpoint):
    batches = token_batches()
    sweep = CalibrationSweep(checkpoint, batches, torch.zeros(96, dtype=torch.long), ["text"], progress=False)
    for _ in sweep.run(None):
        pass
    model = load_stock(checkpoint)
    with torch.no_grad():
        logits = [model(**batch).logits for batch in batches]
    for swept, stock in zip(sweep.head_logits(batches, sweep.last_hidden), logits, strict=True):
        torch.testing.assert_close(swept, stock, rtol=0, atol=1e-5)


def test_nemo_export_reads_as_the_per_expert_layout(checkpoint, nemo_export):
    adapter = checkpoint_adapter(nemo_export)
    stock = load_stock(checkpoint)
    for directory in (checkpoint, nemo_export):
        with CheckpointReader(directory) as reader:
            keys, _ = group_keys_by_layer(reader, adapter)
            for layer in adapter.moe_layers():
                disk = reader.read(keys[layer])
                moe, rest, layout = adapter.split_layer(layer, disk)
                assert layout == ("fused_transposed" if directory == nemo_export else "per_expert")
                joined = adapter.join_layer(layer, moe, rest, layout)
                assert set(joined) == set(disk) and all(torch.equal(joined[k], disk[k]) for k in disk)
            for layer in range(adapter.num_layers):
                moe, rest, _ = adapter.split_layer(layer, reader.read(keys[layer]))
                state = adapter.runtime_layer_state(layer, moe, rest)
                expected = adapter.decoder_layers(stock)[layer].state_dict()
                assert set(state) == set(expected) and all(torch.equal(state[k], expected[k]) for k in expected)
    ids = token_batches()[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(load_stock(nemo_export)(input_ids=ids).logits, stock(input_ids=ids).logits)


def test_prune_keeps_the_speech_towers_and_the_nemo_layout(nemo_export, tmp_path):
    from moecompress import api

    calibration = {"tokens": 256, "seq_len": 64}
    api.prune(nemo_export, tmp_path / "out", keep=4, scope="layer", evaluation=None, calibration=calibration)
    before, after = load_file(nemo_export / "model.safetensors"), {}
    for path in (tmp_path / "out").glob("*.safetensors"):
        after.update(load_file(path))
    towers = [key for key in before if key.startswith(("perception.", "ctc_timestamp."))]
    assert towers and all(torch.equal(after[key], before[key]) for key in towers)
    assert after["llm.model.layers.1.mixer.experts.gate_and_up_projs"].shape == (4, 64, 32)
    assert after["llm.model.layers.1.mixer.experts.down_projs"].shape == (4, 32, 64)
    model = load_stock(tmp_path / "out")
    assert model.model.language_model.layers[1].mixer.experts.up_proj.shape == (4, 32, 64)


def test_mxfp4_of_the_nemo_export_loads_through_the_plugin(nemo_export, tmp_path):
    import moecompress  # noqa: F401 - the plugin
    from moecompress import api

    api.quantize(nemo_export, tmp_path / "q", scheme="mxfp4", evaluation=None)
    model = load_stock(tmp_path / "q")
    adapter = checkpoint_adapter(tmp_path / "q")
    assert {type(adapter.experts_of(model, layer)).__name__ for layer in adapter.moe_layers()} == {"QuantizedExperts"}
    reference = load_stock(nemo_export).model.language_model.layers[0].mixer.A_log
    assert torch.equal(model.model.language_model.layers[0].mixer.A_log, reference)
