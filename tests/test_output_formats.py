"""Output formats are classes registered by name: a format registered outside moecompress (here, from this file)
is offered by the quantize pass's ``format`` option and runs from the command line, a recipe and the API."""

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import run_cli
from safetensors.torch import load_file

import moecompress
from moecompress.errors import OptionError
from moecompress.quantization.formats import FORMATS, OutputFormat, native, register, unregister
from moecompress.quantization.scheme import QuantizedTensor, QuantScheme
from moecompress.runner.recipes import parse_recipe, run_recipe

MARKER = "toy-dequantised"


class ToyFormat(OutputFormat):
    """The native layout with the routed experts written dequantised to bf16, and a marker in ``config.json``."""

    name = "toy"
    quant_method = MARKER

    def layer_tensors(self, adapter, layer, moe, rest):
        out = native.layer_tensors(adapter, layer, None, rest)
        if moe is None:
            return out
        prefix = adapter.layer_prefix(layer)
        router = adapter.runtime_router_state(moe.weights)
        out.update({prefix + adapter.stored_local_name(name): tensor for name, tensor in router.items()})
        experts = native.experts_module(adapter, layer)
        out[f"{experts}.{adapter.fused_in_name}"] = moe.gate_up.dequantize(torch.bfloat16)
        out[f"{experts}.down_proj"] = moe.down.dequantize(torch.bfloat16)
        return out

    def outside_tensors(self, adapter, tensors):
        return native.outside_tensors(adapter, tensors)

    def config_for(self, adapter, scheme, expert_modules, weight_keys, lowrank=None, salient=None):
        return {"quant_method": MARKER, "scheme": scheme.to_dict(), "dequantised": sorted(expert_modules)}


@pytest.fixture
def toy():
    register(ToyFormat)
    yield
    unregister("toy")


def _weights(out: Path) -> dict[str, torch.Tensor]:
    state = {}
    for path in sorted(out.glob("*.safetensors")):
        state.update(load_file(path))
    return state


def test_a_registered_format_is_offered_and_an_unregistered_one_is_not(toy):
    assert "toy" in FORMATS and list(FORMATS)[:3] == ["native", "gpt-oss", "compressed-tensors"]
    unregister("toy")
    assert "toy" not in FORMATS


def test_a_format_registered_outside_moecompress_runs_from_the_cli_a_recipe_and_the_api(
    toy, tiny_checkpoints, tmp_path
):
    from moecompress.cli.main import app

    source = tiny_checkpoints["qwen3_moe"]
    outs = {name: tmp_path / name for name in ("cli", "recipe", "api", "native")}
    for fmt, out in (("toy", outs["cli"]), ("native", outs["native"])):
        result = CliRunner().invoke(app, ["quantize", str(source), "--out", str(out), "--format", fmt, "--no-eval"])
        assert result.exit_code == 0, result.output
    document = {"model": str(source), "passes": [{"quantize": {"format": "toy"}}]}
    run_recipe(parse_recipe(document), source, outs["recipe"], progress=False)
    moecompress.quantize(source, outs["api"], format="toy", evaluation=None)

    configs = {name: json.loads((out / "config.json").read_text()) for name, out in outs.items()}
    assert configs["cli"]["quantization_config"]["quant_method"] == MARKER
    assert configs["cli"]["quantization_config"]["dequantised"]
    cli, recipe, api, stored = (_weights(outs[name]) for name in ("cli", "recipe", "api", "native"))
    assert cli.keys() == recipe.keys() == api.keys()
    assert all(torch.equal(cli[key], recipe[key]) and torch.equal(cli[key], api[key]) for key in cli)

    scheme = QuantScheme.from_dict(configs["cli"]["quantization_config"]["scheme"])
    experts = [key for key in cli if key.endswith(("gate_up_proj", "down_proj"))]
    assert experts and all(cli[key].dtype == torch.bfloat16 for key in experts)
    for key in experts:
        packed = QuantizedTensor(scheme, tuple(cli[key].shape), stored[key], stored[f"{key}_scales"])
        assert torch.equal(cli[key], packed.dequantize(torch.bfloat16)), key
    assert {key for key in cli if key not in experts} == {
        key for key in stored if key not in experts and not key.endswith("_scales")
    }


def test_a_format_refusal_comes_from_the_format(toy, tiny_checkpoints, tmp_path, monkeypatch):
    from moecompress.cli.main import app

    monkeypatch.setattr(ToyFormat, "unsupported", lambda self, adapter, scheme, targets: "the toy holds no experts")
    result = CliRunner().invoke(
        app,
        ["quantize", str(tiny_checkpoints["qwen3_moe"]), "--out", str(tmp_path / "o"), "--format", "toy"],
    )
    assert isinstance(result.exception, OptionError) and str(result.exception).endswith(": the toy holds no experts")


def test_salient_weights_are_refused_where_the_format_has_no_place_for_them(toy, tiny_checkpoints, tmp_path):
    from moecompress.cli.main import app

    args = ["quantize", str(tiny_checkpoints["qwen3_moe"]), "--out", str(tmp_path / "o"), "--format", "toy"]
    result = CliRunner().invoke(app, [*args, "--salient-fraction", "0.01"])
    assert isinstance(result.exception, OptionError)
    assert "stored in the native format only, not --format toy" in str(result.exception)


def test_an_unregistered_format_is_refused_in_one_line(tiny_checkpoints, tmp_path):
    result = run_cli("quantize", str(tiny_checkpoints["qwen3_moe"]), "--out", str(tmp_path / "o"), "--format", "toy")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and "toy" in result.stderr
