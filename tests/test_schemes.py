"""Schemes are classes registered by name: nothing outside the scheme modules asks which scheme it holds, and a
scheme registered from outside moecompress (here, from this file) runs from the command line, a recipe and the
API, and loads through the plugin."""

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import load_stock, run_cli

import moecompress
from moecompress.quantization.scheme import SCHEMES, QuantScheme
from moecompress.quantization.schemes import SchemeKind, register, unregister
from moecompress.runner.recipes import parse_recipe, run_recipe

ROOT = Path(__file__).resolve().parents[1]
SCHEME_MODULES = {ROOT / "moecompress/quantization/scheme.py"} | set(
    (ROOT / "moecompress/quantization/schemes").glob("*.py")
)
ASKS_WHICH_SCHEME = re.compile(
    r"\bis_float\b|\bis_binary\b|scheme\.name\s*[!=]=|\.scheme\s*[!=]=\s*[\"']|\.scheme\s+(not\s+)?in\s*\("
)


def test_no_code_outside_the_scheme_modules_asks_which_scheme_it_holds():
    asking = []
    for path in sorted([*ROOT.glob("moecompress/**/*.py"), *ROOT.glob("scripts/*.py")]):
        if path in SCHEME_MODULES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if ASKS_WHICH_SCHEME.search(line):
                asking.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert asking == []


def test_the_check_finds_a_flag_question():
    assert ASKS_WHICH_SCHEME.search("if scheme.is_float and not salient:")
    assert ASKS_WHICH_SCHEME.search('if self.scheme == "mxfp4":')
    assert not ASKS_WHICH_SCHEME.search("if tensor.is_floating_point():")


class Toy(SchemeKind):
    """A 3-bit uniform symmetric grid (codes 0..7, value ``(code - 4)·s``), stored in nibbles."""

    name = "toy"
    bits = 4
    group_sizes = (32, 64)

    def fit(self, scheme, groups, exclude):
        if exclude is not None:
            groups = groups.masked_fill(exclude, 0.0)
        scale = groups.abs().amax(dim=-1, keepdim=True) / 4
        return torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.bfloat16).float()

    def codes(self, scheme, values, grid):
        return (torch.round(values.float() / grid) + 4).clamp(0, 7).to(torch.uint8)

    def values(self, scheme, codes, grid):
        return (codes.float() - 4) * grid


@pytest.fixture
def toy():
    register(Toy)
    yield
    unregister("toy")


def test_a_registered_scheme_is_offered_and_unregistered_one_is_not(toy):
    assert "toy" in SCHEMES
    assert QuantScheme("toy").describe() == "toy (group 32)"
    with pytest.raises(ValueError, match="group size"):
        QuantScheme("toy", group_size=128)


def _expert_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    state = {}
    for path in sorted(out.glob("*.safetensors")):
        state.update(load_file(path))
    return {key: value for key, value in state.items() if "experts" in key}


def test_a_scheme_registered_outside_moecompress_runs_from_the_cli_a_recipe_and_the_api(
    toy, tiny_checkpoints, tmp_path
):
    from moecompress.cli.main import app

    source = tiny_checkpoints["qwen3_moe"]
    cli_out, recipe_out, api_out = tmp_path / "cli", tmp_path / "recipe", tmp_path / "api"
    result = CliRunner().invoke(
        app, ["quantize", str(source), "--out", str(cli_out), "--scheme", "toy", "--no-eval", "-q"]
    )
    assert result.exit_code == 0, result.output
    document = {"model": str(source), "passes": [{"quantize": {"scheme": "toy"}}]}
    run_recipe(parse_recipe(document), source, recipe_out, progress=False)
    moecompress.quantize(source, api_out, scheme="toy", evaluation=None)

    config = json.loads((cli_out / "config.json").read_text())["quantization_config"]
    assert {scheme["name"] for scheme in config["schemes"].values()} == {"toy"}
    cli, recipe, api = (_expert_weights(out) for out in (cli_out, recipe_out, api_out))
    assert cli and all(torch.equal(cli[key], recipe[key]) and torch.equal(cli[key], api[key]) for key in cli)

    packed = next(value for key, value in cli.items() if key.endswith("gate_up_proj"))
    codes = torch.stack([packed & 15, packed >> 4], dim=-1)
    assert int(codes.max()) <= 7, "the toy grid's codes are 3-bit"

    model = load_stock(cli_out)
    adapter = moecompress.families.adapter_for(json.loads((cli_out / "config.json").read_text()))
    experts = adapter.experts_of(model, adapter.moe_layers()[0])
    assert type(experts).__name__ == "QuantizedExperts" and experts.scheme.name == "toy"
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()


def test_an_unregistered_scheme_is_refused_in_one_line(tiny_checkpoints, tmp_path):
    result = run_cli("quantize", str(tiny_checkpoints["qwen3_moe"]), "--out", str(tmp_path / "o"), "--scheme", "toy")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and "toy" in result.stderr
