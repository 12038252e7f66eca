"""Nothing untrusted runs: pickle weights need --allow-pickle and are then read with weights_only=True; a model's
own code (auto_map) runs only with --trust-remote-code."""

import json
import shutil

import pytest
import torch
from helpers import run_cli, tree_hashes
from safetensors.torch import load_file


def _as_pickle(source, target):
    """A copy of ``source`` whose weights are a ``pytorch_model.bin`` instead of safetensors."""
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    (target / "model.safetensors").unlink()
    torch.save(tensors, target / "pytorch_model.bin")
    return target


class _Planted:
    """Unpickling this would create ``marker``: what a hostile checkpoint does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_weights_are_refused_without_the_flag(tiny_with_tokenizer, tmp_path):
    pickled = _as_pickle(tiny_with_tokenizer["qwen3_moe"], tmp_path / "pickled")
    out = tmp_path / "out"
    result = run_cli("quantize", str(pickled), "--out", str(out), "--no-eval")
    assert result.returncode == 2
    assert "pytorch_model.bin" in result.stderr and "--allow-pickle" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()


def test_allowed_pickle_weights_give_the_same_output_as_safetensors(tiny_with_tokenizer, tmp_path):
    source = tiny_with_tokenizer["qwen3_moe"]
    pickled = _as_pickle(source, tmp_path / "pickled")
    before = tree_hashes(pickled)
    args = ("--scheme", "int4", "--no-eval")
    from_pickle = run_cli("quantize", str(pickled), "--out", str(tmp_path / "a"), "--allow-pickle", *args)
    assert from_pickle.returncode == 0, from_pickle.stderr
    from_safetensors = run_cli("quantize", str(source), "--out", str(tmp_path / "b"), *args)
    assert from_safetensors.returncode == 0, from_safetensors.stderr
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert tree_hashes(pickled) == before
    inspect = run_cli("inspect", str(pickled), "--allow-pickle", "--json")
    assert inspect.returncode == 0 and json.loads(inspect.stdout)["family"] == "qwen3_moe"


def test_a_pickle_that_runs_code_is_refused_even_when_pickle_is_allowed(tiny_with_tokenizer, tmp_path):
    hostile = _as_pickle(tiny_with_tokenizer["qwen3_moe"], tmp_path / "hostile")
    marker = tmp_path / "code-ran"
    tensors = torch.load(hostile / "pytorch_model.bin", weights_only=True)
    torch.save({**tensors, "payload": _Planted(marker)}, hostile / "pytorch_model.bin")
    result = run_cli("inspect", str(hostile), "--allow-pickle")
    assert result.returncode == 2 and "weights_only=True" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not marker.exists()


@pytest.fixture
def remote_code_model(tiny_with_tokenizer, tmp_path):
    """A model whose config names its own modelling code; importing that code creates a marker file."""
    target = tmp_path / "remote"
    shutil.copytree(tiny_with_tokenizer["qwen3_moe"], target)
    marker = tmp_path / "remote-code-ran"
    (target / "custom_model.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM\n\n\n"
        "class CustomConfig(Qwen3MoeConfig):\n    pass\n\n\n"
        "class CustomModel(Qwen3MoeForCausalLM):\n    config_class = CustomConfig\n"
    )
    config = json.loads((target / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "custom_model.CustomConfig", "AutoModelForCausalLM": "custom_model.CustomModel"}
    (target / "config.json").write_text(json.dumps(config))
    return target, marker


def test_remote_code_runs_only_with_the_flag(remote_code_model):
    model, marker = remote_code_model
    plain = run_cli("eval", str(model), "--max-tokens", "128", "--seq-len", "32")
    assert plain.returncode == 0, plain.stderr
    assert not marker.exists()
    trusted = run_cli("eval", str(model), "--max-tokens", "128", "--seq-len", "32", "--trust-remote-code")
    assert marker.exists(), trusted.stderr
