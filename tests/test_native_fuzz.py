"""Hostile native checkpoints: a mutated quantization_config or mutated tensors either load into a model whose
forward is finite, or are refused with a UserInputError; never another exception, a hang, or a huge allocation."""

import copy
import json
import resource
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from moecompress.errors import UserInputError
from moecompress.loading import load_adapter, load_model
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint

HOSTILE_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(min_value=-5, max_value=10**9), max_size=10),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@pytest.fixture(scope="module")
def native(tiny_with_tokenizer, tmp_path_factory):
    """A native INT2 checkpoint with low-rank adapters and Rice-coded salient weights."""
    out = tmp_path_factory.mktemp("fuzz") / "native"
    config = QuantizeConfig(scheme="int2", lowrank_rank=1, salient_fraction=0.01)
    quantize_checkpoint(tiny_with_tokenizer["qwen3_moe"], out, config, calib_tokens=512, seq_len=32, progress=False)
    return out


def _paths(config: dict) -> list[tuple[str, ...]]:
    """Every leaf (and list) path inside quantization_config."""
    found = []

    def walk(node, path):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, (*path, key))
        else:
            found.append(path)
            if isinstance(node, list):
                found.extend((*path, i) for i in range(len(node)))

    walk(config, ())
    return found


def _set(node, path, value):
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


def _check_load(directory, finite: bool = True) -> None:
    """Loading raises nothing but UserInputError; a loaded model runs (with finite logits where the mutation
    cannot have planted huge float values)."""
    try:
        model = load_model(directory, load_adapter(directory))
    except UserInputError:
        return
    with torch.inference_mode():
        logits = model(input_ids=torch.arange(16)[None] % 64).logits
    assert not finite or torch.isfinite(logits).all()


@settings(max_examples=30, deadline=20000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_quantization_config_loads_or_is_refused(native, tmp_path_factory, data):
    target = tmp_path_factory.mktemp("mutant") / "m"
    shutil.copytree(native, target)
    config = json.loads((native / "config.json").read_text())
    quantization = config["quantization_config"]
    path = data.draw(st.sampled_from(_paths(quantization)))
    mutated = copy.deepcopy(config)
    _set(mutated["quantization_config"], path, data.draw(HOSTILE_VALUES))
    (target / "config.json").write_text(json.dumps(mutated))
    _check_load(target)


@settings(max_examples=20, deadline=20000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_tensors_load_or_are_refused(native, tmp_path_factory, data):
    target = tmp_path_factory.mktemp("mutant") / "t"
    shutil.copytree(native, target)
    tensors = load_file(native / "model.safetensors")
    key = data.draw(st.sampled_from(sorted(k for k in tensors if ".experts." in k)))
    action = data.draw(st.sampled_from(["drop", "truncate", "retype", "scribble"]))
    tensor = tensors[key]
    if action == "drop":
        del tensors[key]
    elif action == "truncate":
        tensors[key] = tensor.reshape(-1)[: max(0, tensor.numel() - data.draw(st.integers(1, 64)))].clone()
    elif action == "retype":
        tensors[key] = tensor.to(torch.float32) if tensor.dtype != torch.float32 else tensor.to(torch.bfloat16)
    else:
        raw = tensor.contiguous().view(torch.uint8).reshape(-1).clone()
        where = data.draw(st.lists(st.integers(0, raw.numel() - 1), min_size=1, max_size=8))
        raw[where] = torch.tensor(
            data.draw(st.lists(st.integers(0, 255), min_size=len(where), max_size=len(where))), dtype=torch.uint8
        )
        tensors[key] = raw.view(tensor.dtype).reshape(tensor.shape)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    _check_load(target, finite=not (action == "scribble" and tensor.is_floating_point()))


def test_fuzzing_stayed_within_bounded_memory():
    """Run after the fuzz tests in this module: no mutant made the process allocate gigabytes."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert peak_kib < 6 * 2**20
