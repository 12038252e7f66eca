"""Expert merging with router recalibration on families beyond tests/test_prune_merge.py's two: every layer merged
into groups and its router refitted (the refit's error never above the merge's), the output loads the way the
family's outputs load (stock transformers at layer scope, the plugin at global scope) and runs, and in the loaded
model the refitted router lowers the first MoE block's error against the original block as the report says."""

import json

import pytest
import torch
import transformers
from helpers import load_stock
from synthetic import save_tiny_source
from synthetic_quantized import add_mtp_layer

from moecompress.calibration.model_inputs import calibration_batches
from moecompress.families import adapter_for
from moecompress.passes.prune_experts import PruneExpertsConfig, prune_experts
from moecompress.runner.pipeline import CALIBRATION_BATCH

CALIB = dict(calib="builtin:prose", calib_tokens=512, seq_len=64, eval_tokens=None, progress=False)
CASES = {
    "mixtral": "layer",
    "gpt_oss": "layer",
    "deepseek_v3": "layer",
    "qwen3_vl_moe": "layer",
    "llama4": "layer",
    "longcat_flash": "layer",
    "gemma4": "layer",
    "ergo": "layer",
    "deepseek_v4": "layer",
    "deepseek_v3_mtp": "layer",
    "qwen3_moe": "global",
}


@pytest.fixture(autouse=True)
def one_thread():
    """The refit's many small steps: on a loaded 2-core machine two intra-op threads make them tens of times slower
    (measured: 1 s against 42 s for mixtral's), and these tiny layers gain nothing from a second thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(directory):
    return json.loads((directory / "config.json").read_text())


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge_families")
    made = {}

    def get(case):
        if case not in made:
            family = case.removesuffix("_mtp")
            made[case] = save_tiny_source(family, root / case)
            if case.endswith("_mtp"):
                add_mtp_layer(made[case])
        return made[case]

    return get


def _load(directory, scope):
    if scope == "layer":
        return load_stock(directory)
    import moecompress  # noqa: F401  (registers the plugin that loads per-layer expert counts)

    auto = getattr(transformers, adapter_for(_config(directory)).auto_class)
    return auto.from_pretrained(directory, dtype=torch.float32).eval()


def _block_errors(adapter, models, ids):
    """The first MoE block of each of ``models[1:]``, fed what that block receives in ``models[0]``: its squared
    error against ``models[0]``'s block output."""
    layer = adapter.moe_layers()[0]
    seen = {}

    def keep(module, args, kwargs, output):
        seen["args"], seen["kwargs"] = args, kwargs
        seen["out"] = output[0] if isinstance(output, tuple) else output

    block = adapter.moe_block_of(models[0], layer)
    handle = block.register_forward_hook(keep, with_kwargs=True)
    with torch.no_grad():
        models[0](input_ids=ids, use_cache=False)
    handle.remove()
    errors = []
    for model in models[1:]:
        with torch.no_grad():
            out = adapter.moe_block_of(model, layer)(*seen["args"], **seen["kwargs"])
        out = out[0] if isinstance(out, tuple) else out
        errors.append(float((out - seen["out"]).double().pow(2).sum()))
    return layer, errors


@pytest.mark.parametrize("case", list(CASES))
def test_merge_with_router_refit_loads_and_the_refit_lowers_the_error(case, sources, tmp_path):
    source, scope = sources(case), CASES[case]
    adapter = adapter_for(_config(source))
    merged = PruneExpertsConfig(method="merge", ratio=0.5, scope=scope)
    report = prune_experts(
        source, tmp_path / "refit", PruneExpertsConfig(**{**vars(merged), "recalibrate_router": True}), **CALIB
    )
    plain = prune_experts(source, tmp_path / "plain", merged, **CALIB)
    layers = report["layers"]
    moe_layers = [str(layer) for layer in adapter.moe_layers()]
    if case.endswith("_mtp"):
        assert report["mtp"]["calibrated"] == [int(max(layers, key=int))]
        moe_layers.append(max(layers, key=int))
    assert sorted(layers, key=int) == moe_layers
    for name, entry in layers.items():
        groups = entry["merged"]
        assert sorted(e for group in groups for e in group) == list(range(adapter.num_experts)), name
        assert any(len(group) > 1 for group in groups), name
        assert entry["merged"] == plain["layers"][name]["merged"], name
        refit = entry["router_refit"]
        assert refit["error_after"] <= refit["error_before"], name
    assert report["experts_after"] < report["experts_before"]

    original, refitted, unrefitted = (_load(d, scope) for d in (source, tmp_path / "refit", tmp_path / "plain"))
    batches, _, _ = calibration_batches(
        adapter, source, CALIB["calib"], CALIB["calib_tokens"], CALIB["seq_len"], CALIBRATION_BATCH, 0, 224
    )
    ids = torch.cat([batch["input_ids"] for batch in batches])
    with torch.no_grad():
        assert torch.isfinite(refitted(input_ids=ids[:2]).logits).all()
    layer, (after, before) = _block_errors(adapter, (original, refitted, unrefitted), ids)
    refit = layers[str(layer)]["router_refit"]
    ratio = refit["error_after"] / refit["error_before"]
    if adapter.moe_block_name:
        assert after / before == pytest.approx(ratio, abs=0.02), (layer, refit)
    else:  # the block is the decoder layer (Gemma 4): the routed output joins a dense MLP's under norms
        assert after < before if ratio < 0.99 else after <= before * 1.01, (layer, refit)
