"""A pass is one module and one registry line: a layer pass registered from this file (its config dataclass, its
LayerPass subclass, one :data:`~moecompress.passes.registry.PASSES` entry) runs from ``moecompress run``, a recipe
and the API through the pipeline, with the same output, and is planned, described and refused like the built-in
passes; a whole-model pass registered from here runs from a recipe and as a one-pass pipeline run (as the ``qat``
and ``prune-heads`` commands do) with the same output, written by the pipeline's writer."""

import json
from dataclasses import asdict, dataclass, field, replace

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

import moecompress
from moecompress.errors import OptionError
from moecompress.passes.base import InputFacts, LayerPass, Needs, PassEntry
from moecompress.passes.options import check_declared, option
from moecompress.passes.registry import PASSES
from moecompress.runner.recipes import parse_recipe, run_recipe


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
    from moecompress.runner.pipeline import plan_stages

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


@dataclass(frozen=True)
class ScaleNormsConfig:
    factor: float = field(default=2.0, metadata=option("What every decoder layer's norm weights are multiplied by."))
    seed: int = field(default=0, metadata=option("Unused; a one-pass run seeds its calibration with it."))

    def validate(self) -> None:
        check_declared(self)

    def check_input(self, facts: InputFacts) -> None:
        CHECKED_INPUTS.append(facts)


CHECKED_INPUTS: list[InputFacts] = []


class ScaledNorms(LayerPass):
    """What the toy whole-model pass writes: the input with its layers' norm weights scaled."""

    name = "scale_norms"

    def __init__(self, config, adapter):
        super().__init__(config)
        self.adapter = adapter

    def rewrite_rest(self, layer, rest):
        scaled = {}
        for key, tensor in rest.items():
            norm = self.adapter.classify_key(key) == "norms"
            scaled[key] = (tensor.float() * self.config.factor).to(tensor.dtype) if norm else tensor
        return scaled

    def report(self):
        return {"pass": self.name, "factor": self.config.factor}


def _scale_norms(source, target, config, *, calibration, evaluation, overwrite, progress):
    from moecompress.loading import load_adapter
    from moecompress.runner.pipeline import write_model

    write_model(source, target, ScaledNorms(config, load_adapter(source)), overwrite=overwrite, progress=progress)
    return {"pass": "scale_norms", "factor": config.factor, "evaluated": evaluation is not None}


@pytest.fixture
def scale_norms(monkeypatch):
    CHECKED_INPUTS.clear()
    monkeypatch.setitem(PASSES, "scale_norms", PassEntry("scale_norms", ScaleNormsConfig, run_whole_model=_scale_norms))


def test_a_whole_model_pass_registered_from_outside_runs_from_a_recipe_and_as_one_pass(
    scale_norms, tiny_with_tokenizer, tmp_path
):
    from moecompress.loading import load_adapter
    from moecompress.runner.pipeline import run_one_pass

    source = tiny_with_tokenizer["qwen3_moe"]
    calibration = {"tokens": 256, "seq_len": 32}
    recipe = parse_recipe(
        {"model": str(source), "calibration": calibration, "passes": [{"scale_norms": {"factor": 0.5}}]}
    )
    config = recipe.passes[0][1]
    report = run_recipe(recipe, source, tmp_path / "recipe", progress=False)
    assert report["pass"] == "scale_norms"
    assert [(facts.model_dir, facts.quantized) for facts in CHECKED_INPUTS] == [(source, None)]
    one = run_one_pass(
        "scale_norms",
        config,
        source,
        tmp_path / "one",
        calib="builtin:prose",
        calib_tokens=256,
        seq_len=32,
        image_size=32,
        eval_data=None,
        eval_tokens=None,
        overwrite=False,
        progress=False,
        resume=False,
    )
    assert one == {"pass": "scale_norms", "factor": 0.5, "evaluated": False}
    written = tmp_path / "one" / "model.safetensors"
    assert written.read_bytes() == (tmp_path / "recipe" / "model.safetensors").read_bytes()
    original, scaled = load_file(source / "model.safetensors"), load_file(written)
    adapter = load_adapter(source)
    norms = [key for key in original if adapter.layer_of_key(key) is not None and adapter.classify_key(key) == "norms"]
    assert norms and scaled.keys() == original.keys()
    for key, tensor in original.items():
        expected = (tensor.float() * 0.5).to(tensor.dtype) if key in norms else tensor
        assert torch.equal(scaled[key], expected), key
    assert json.loads((tmp_path / "one" / "moecompress_report.json").read_text()) == {
        "pass": "scale_norms",
        "factor": 0.5,
    }
