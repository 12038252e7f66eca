"""The gpt-oss MXFP4 layout (``quant_method: mxfp4``) loads with the network unreachable: transformers would fetch
the hub kernel ``kernels-community/gpt-oss-triton-kernels``; after ``import moecompress`` it dequantises."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import moecompress  # noqa: F401  (the plugin)
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint

NO_NETWORK = """
import socket, sys
def refuse(*args, **kwargs):
    raise OSError("network unreachable (test)")
socket.socket.connect = refuse
socket.create_connection = refuse
from moecompress.cli.main import main
sys.argv = ["moecompress", *sys.argv[1:]]
main()
"""


def _refuse(*args, **kwargs):
    raise OSError("network unreachable (test)")


@pytest.fixture(scope="module")
def gpt_oss_outputs(tiny_with_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_offline")
    source = tiny_with_tokenizer["gpt_oss"]
    quantize_checkpoint(source, root / "native", QuantizeConfig(), progress=False)
    quantize_checkpoint(source, root / "export", QuantizeConfig(format="gpt-oss"), progress=False)
    return root / "native", root / "export"


def _eval_offline(directory, json_out, hub_offline: bool):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if hub_offline:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env.pop("HF_HUB_OFFLINE", None)
    args = ["eval", str(directory), "--seq-len", "64", "--max-tokens", "1024", "--json-out", str(json_out)]
    done = subprocess.run(
        [sys.executable, "-c", NO_NETWORK, *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(json_out.read_text())


@pytest.mark.parametrize("hub_offline", [True, False])
def test_eval_of_the_gpt_oss_export_runs_without_network(gpt_oss_outputs, tmp_path, hub_offline):
    native, export = gpt_oss_outputs
    got = _eval_offline(export, tmp_path / "export.json", hub_offline)
    want = _eval_offline(native, tmp_path / "native.json", hub_offline)
    assert got["perplexity"] == pytest.approx(want["perplexity"], rel=1e-4)


def test_plugin_loads_the_gpt_oss_export_without_network(gpt_oss_outputs, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(socket.socket, "connect", _refuse)
    monkeypatch.setattr(socket, "create_connection", _refuse)
    native, export = gpt_oss_outputs
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(native, dtype=torch.float32).eval()
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, atol=2e-5, rtol=1e-5)


def test_quantize_evaluates_its_gpt_oss_output_without_network(tiny_with_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(socket.socket, "connect", _refuse)
    monkeypatch.setattr(socket, "create_connection", _refuse)
    report = quantize_checkpoint(
        tiny_with_tokenizer["gpt_oss"],
        tmp_path / "export",
        QuantizeConfig(format="gpt-oss"),
        seq_len=64,
        eval_data="builtin:prose",
        eval_tokens=1024,
        progress=False,
    )
    assert "perplexity" in json.dumps(report)
