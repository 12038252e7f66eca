"""A pass is one module and one registry line: a layer pass registered from this file (its config dataclass, its
LayerPass subclass, one :data:`~moecompress.passes.registry.PASSES` entry) runs from ``moecompress run``, a recipe
and the API through the pipeline, with the same output, and is planned, described and refused like the built-in
passes."""

import json
from dataclasses import asdict, dataclass, field, replace

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

import moecompress
from moecompress.errors import OptionError
from moecompress.passes.base import LayerPass, Needs, PassEntry
from moecompress.passes.options import check_declared, option
from moecompress.passes.registry import PASSES
from moecompress.recipes import parse_recipe, run_recipe


@dataclass(frozen=True)
class ScaleDownConfig:
    factor: float = field(default=0.5, metadata=option("What every routed expert's down_proj is multiplied by.", min=0))

    def validate(self) -> None:
        check_declared(self)
        if self.factor == 0:
            raise OptionError("{factor} 0 would zero every expert", ScaleDownConfig)


class ScaleDownPass(LayerPass):
    """Multiplies every routed expert's down projection by ``factor``; reads no calibration."""

    name = "scale_down"

    def needs(self) -> Needs:
        return Needs(rewrites=f"scale every expert's down_proj by {self.config.factor}")

    def rewrite(self, layer, block, capture):
        if block is None:
            return None
        return replace(block, down=(block.down.float() * self.config.factor).to(block.down.dtype))

    def report(self):
        return {"pass": self.name, "config": asdict(self.config)}


@pytest.fixture
def scale_down(monkeypatch):
    monkeypatch.setitem(PASSES, "scale_down", PassEntry("scale_down", ScaleDownConfig, layer_pass=ScaleDownPass))


def _weights(out):
    return load_file(out / "model.safetensors")


def test_a_pass_registered_from_outside_runs_from_the_cli_a_recipe_and_the_api(scale_down, tiny_checkpoints, tmp_path):
    from moecompress.cli.main import app

    source = tiny_checkpoints["qwen3_moe"]
    document = {"model": str(source), "passes": [{"scale_down": {"factor": 0.25}}]}
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(document))
    cli_out, recipe_out, api_out = tmp_path / "cli", tmp_path / "recipe", tmp_path / "api"

    dry = CliRunner().invoke(app, ["run", str(recipe_file), "--out", str(cli_out), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "one layer pipeline of scale_down" in dry.output and "scale every expert's down_proj by 0.25" in dry.output
    result = CliRunner().invoke(app, ["run", str(recipe_file), "--out", str(cli_out), "-q"])
    assert result.exit_code == 0, result.output
    run_recipe(parse_recipe(document), source, recipe_out, progress=False)
    moecompress.run(document, out=api_out)

    original, cli = load_file(source / "model.safetensors"), _weights(cli_out)
    scaled = [key for key in original if ".experts." in key and "down_proj" in key]
    assert scaled and cli.keys() == original.keys()
    for key, tensor in original.items():
        expected = (tensor.float() * 0.25).to(tensor.dtype) if key in scaled else tensor
        assert torch.equal(cli[key], expected), key
    for out in (recipe_out, api_out):
        assert (out / "model.safetensors").read_bytes() == (cli_out / "model.safetensors").read_bytes()
        assert (out / "config.json").read_bytes() == (cli_out / "config.json").read_bytes()
    report = json.loads((cli_out / "moecompress_report.json").read_text())
    assert report["pass"] == "scale_down" and report["config"] == {"factor": 0.25}
    assert report["recipe"]["passes"] == ["scale_down: factor=0.25"]


def test_a_registered_pass_shares_a_pipeline_stage_with_the_built_in_ones(scale_down, tiny_with_tokenizer, tmp_path):
    """Pruning, then the toy pass, in one rewriting sweep: the kept experts' down_proj scaled."""
    source = tiny_with_tokenizer["qwen3_moe"]
    document = {
        "model": str(source),
        "calibration": {"tokens": 256, "seq_len": 32},
        "passes": [{"prune_experts": {"method": "frequency", "ratio": 0.25}}, {"scale_down": {"factor": 2.0}}],
    }
    recipe = parse_recipe(document)
    from moecompress.pipeline import plan_stages

    assert [stage.names for stage in plan_stages(recipe.passes)] == [["prune_experts", "scale_down"]]
    both = run_recipe(recipe, source, tmp_path / "both", progress=False)
    pruned_only = {**document, "passes": document["passes"][:1]}
    run_recipe(parse_recipe(pruned_only), source, tmp_path / "pruned", progress=False)
    assert both["pass"] == "scale_down" and [p["pass"] for p in both["previous_passes"]] == ["prune_experts"]
    pruned, scaled = _weights(tmp_path / "pruned"), _weights(tmp_path / "both")
    assert pruned.keys() == scaled.keys()
    downs = [key for key in pruned if ".experts." in key and "down_proj" in key]
    assert downs
    for key, tensor in pruned.items():
        expected = (tensor.float() * 2.0).to(tensor.dtype) if key in downs else tensor
        assert torch.equal(scaled[key], expected), key


def test_a_registered_pass_is_validated_like_the_built_in_ones(scale_down, tiny_checkpoints, tmp_path):
    source = tiny_checkpoints["qwen3_moe"]
    with pytest.raises(OptionError, match=r"passes\[0\]\.scale_down\.factor"):
        parse_recipe({"passes": [{"scale_down": {"factor": -1.0}}]})
    with pytest.raises(moecompress.errors.UserInputError, match="unknown key"):
        parse_recipe({"passes": [{"scale_down": {"scale": 2.0}}]})
    with pytest.raises(OptionError, match="factor"):
        moecompress.run({"model": str(source), "passes": [{"scale_down": {"factor": 0.0}}]}, out=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_an_unregistered_pass_is_unknown():
    with pytest.raises(moecompress.errors.UserInputError, match="unknown pass"):
        parse_recipe({"passes": [{"scale_down": {}}]})
