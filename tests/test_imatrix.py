"""``--imatrix-out``: the quantisation pass's calibration written as a llama.cpp importance matrix. The file is read
back with the ``gguf`` package and its sums compared with sums computed here from a stock transformers forward of
the same calibration windows; with a llama.cpp build (``MOECOMPRESS_LLAMA_CPP`` names the converter,
``MOECOMPRESS_LLAMA_CPP_BIN`` a directory holding ``llama-quantize``; otherwise skipped) ``llama-quantize``
uses it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import load_stock, run_cli
from synthetic import TINY_CONFIGS, save_tiny_source

import moecompress
from moecompress.calibration.model_inputs import calibration_batches
from moecompress.errors import UserInputError
from moecompress.export.imatrix import covered_tensors
from moecompress.export.llama_cpp import find_converter
from moecompress.families.qwen_moe import Qwen3MoeAdapter
from moecompress.loading import load_adapter
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint

BUILTIN = Path(moecompress.__file__).parent / "assets" / "tiny-moe"
TOKENS, SEQ_LEN = 512, 128


def _read(path: Path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: (list(t.shape), np.array(t.data), t.tensor_type) for t in reader.tensors}
    return fields, tensors


@torch.no_grad()
def _expected(model_dir: Path, shared: bool) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per tensor name, (sums, counts) from the stock model's forward of the calibration windows: each MoE block's
    input captured by a hook, routed by its own router (softmax, top-k), the experts' intermediate activation
    computed from its own weights; every other matrix's input (attention, shared expert, dense MLP) captured by a
    forward pre-hook on its module, and the output head's input by a hook on the final norm (untied heads only)."""
    adapter = load_adapter(model_dir)
    batches, _, _ = calibration_batches(adapter, model_dir, "builtin:prose", TOKENS, SEQ_LEN, 8, 0, 224)
    model = load_stock(model_dir, torch.float32)
    inputs: dict[int, list[torch.Tensor]] = {}
    matrices: dict[str, list[torch.Tensor]] = {}

    def keep(name: str, rows: torch.Tensor) -> None:
        matrices.setdefault(name, []).append(rows.reshape(-1, rows.shape[-1]))

    handles = []
    for i, layer in enumerate(model.model.layers):
        handles.append(
            layer.mlp.register_forward_hook(lambda m, a, o, i=i: inputs.setdefault(i, []).append(a[0].flatten(0, 1)))
        )
        modules = {f"attn_{n}": f"self_attn.{n}_proj" for n in ("q", "k", "v")} | {"attn_output": "self_attn.o_proj"}
        if not hasattr(layer.mlp, "experts"):
            modules |= {f"ffn_{n}": f"mlp.{n}_proj" for n in ("gate", "up", "down")}
        elif shared:
            modules |= {f"ffn_{n}_shexp": f"mlp.shared_expert.{n}_proj" for n in ("gate", "up", "down")}
            modules["ffn_gate_inp_shexp"] = "mlp.shared_expert_gate"
        for name, path in modules.items():
            hook = lambda m, a, name=f"blk.{i}.{name}.weight": keep(name, a[0])  # noqa: E731
            handles.append(layer.get_submodule(path).register_forward_pre_hook(hook))
    if not model.config.tie_word_embeddings:
        handles.append(model.model.norm.register_forward_hook(lambda m, a, o: keep("output.weight", o)))
    for batch in batches:
        model(**batch)
    for handle in handles:
        handle.remove()
    expected = {}
    for name, rows in matrices.items():
        x = torch.cat(rows).double()
        expected[name] = (x.pow(2).sum(0).numpy(), np.array([float(x.shape[0])]))
    top_k = model.config.num_experts_per_tok
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        if not hasattr(mlp, "experts"):
            continue
        x = torch.cat(inputs[i]).double()
        ids = torch.topk(F.linear(x, mlp.gate.weight.double()), top_k, dim=-1).indices
        gate_up, down = mlp.experts.gate_up_proj.double(), mlp.experts.down_proj.double()
        width, experts = down.shape[-1], gate_up.shape[0]
        routed, hidden = np.zeros((experts, x.shape[1])), np.zeros((experts, width))
        counts = np.zeros((experts, 1))
        for e in range(experts):
            rows = x[(ids == e).any(dim=-1)]
            gate, up = F.linear(rows, gate_up[e]).chunk(2, dim=-1)
            routed[e] = rows.pow(2).sum(0).numpy()
            hidden[e] = (F.silu(gate) * up).pow(2).sum(0).numpy()
            counts[e] = rows.shape[0]
        every, tokens = x.pow(2).sum(0).numpy(), np.array([float(x.shape[0])])
        names = {"ffn_gate_exps": (routed, counts), "ffn_up_exps": (routed, counts), "ffn_down_exps": (hidden, counts)}
        names["ffn_gate_inp"] = (every, tokens)
        expected.update({f"blk.{i}.{name}.weight": value for name, value in names.items()})
    return expected


def _check_values(path: Path, expected: dict) -> None:
    fields, tensors = _read(path)
    assert fields["general.type"] == "imatrix"
    assert "general.architecture" not in fields  # llama-imatrix writes none
    assert fields["imatrix.datasets"] == ["builtin:prose"]
    assert fields["imatrix.chunk_count"] == TOKENS // SEQ_LEN
    assert fields["imatrix.chunk_size"] == SEQ_LEN
    assert sorted(tensors) == sorted(f"{name}.{part}" for name in expected for part in ("in_sum2", "counts"))
    assert list(tensors) == [f"{name}.{part}" for name in sorted(expected) for part in ("in_sum2", "counts")]
    for name, (sums, counts) in expected.items():
        shape, values, kind = tensors[f"{name}.in_sum2"]
        assert kind == gguf.GGMLQuantizationType.F32
        assert shape == list(sums.shape[::-1])  # GGUF's ne order: [width, experts], or [width]
        np.testing.assert_allclose(values, sums, rtol=1e-4, err_msg=name)
        shape, values, _ = tensors[f"{name}.counts"]
        assert shape == list(counts.shape[::-1])
        np.testing.assert_array_equal(values, counts, err_msg=name)


def test_routed_sums_and_counts_equal_those_of_the_stock_forward(tmp_path):
    target = tmp_path / "tiny.imatrix"
    config = QuantizeConfig(scheme="mxfp4", imatrix_out=str(target))
    report = quantize_checkpoint(BUILTIN, tmp_path / "q", config, calib_tokens=TOKENS, seq_len=SEQ_LEN, progress=False)
    expected = _expected(BUILTIN, shared=False)
    assert len(expected) == 4 * 8  # attention q, k, v, output; router; gate, up, down experts (a tied head)
    _check_values(target, expected)
    _, tensors = _read(target)
    assert tensors["blk.0.ffn_gate_exps.weight.in_sum2"][0] == [128, 8]
    assert tensors["blk.0.ffn_down_exps.weight.in_sum2"][0] == [256, 8]
    assert tensors["blk.0.ffn_gate_exps.weight.counts"][0] == [1, 8]
    assert tensors["blk.0.ffn_gate_inp.weight.in_sum2"][0] == [128]
    # every calibration token goes to top_k = 2 experts
    assert tensors["blk.2.ffn_down_exps.weight.counts"][1].sum() == 2 * TOKENS
    assert report["imatrix"]["layers"] == [0, 1, 2, 3]
    assert report["imatrix"]["tensors_per_layer"] == covered_tensors(Qwen3MoeAdapter({}))
    assert not list(tmp_path.glob(".*tmp"))


def test_gptq_calibration_writes_the_same_first_layer(tmp_path):
    """With GPTQ the later layers calibrate on the quantised earlier ones; the first layer's inputs are the model's."""
    rtn, gptq = tmp_path / "rtn.imatrix", tmp_path / "gptq.imatrix"
    common = dict(calib_tokens=TOKENS, seq_len=SEQ_LEN, progress=False)
    quantize_checkpoint(BUILTIN, tmp_path / "a", QuantizeConfig(scheme="int4", imatrix_out=str(rtn)), **common)
    config = QuantizeConfig(scheme="int4", method="gptq", imatrix_out=str(gptq))
    quantize_checkpoint(BUILTIN, tmp_path / "b", config, **common)
    (_, first), (_, second) = _read(rtn), _read(gptq)
    assert first.keys() == second.keys()
    for name in first:
        if name.startswith("blk.0."):
            np.testing.assert_array_equal(first[name][1], second[name][1])
    later = "blk.3.ffn_down_exps.weight.in_sum2"
    assert not np.array_equal(first[later][1], second[later][1])


def _qwen2(directory: Path, monkeypatch, dense: list[int]) -> Path:
    """Tiny Qwen2-MoE (3 layers, a shared expert, an untied head) whose layers ``dense`` are dense MLPs."""
    monkeypatch.setitem(TINY_CONFIGS["qwen2_moe"], "mlp_only_layers", dense)
    source = save_tiny_source("qwen2_moe", directory)
    return source


@pytest.mark.parametrize("dense", [[1], [2]])
def test_shared_expert_dense_layer_and_head_inputs_are_covered(tmp_path, monkeypatch, dense):
    """The last layer dense: its entries and the head's are collected after the writer's last MoE layer."""
    source = _qwen2(tmp_path / "qwen2", monkeypatch, dense)
    target = tmp_path / "qwen2.imatrix"
    config = QuantizeConfig(scheme="mxfp4", imatrix_out=str(target))
    report = quantize_checkpoint(source, tmp_path / "q", config, calib_tokens=TOKENS, seq_len=SEQ_LEN, progress=False)
    expected = _expected(source, shared=True)
    moe = next(layer for layer in range(3) if layer not in dense)
    for name in (f"blk.{dense[0]}.ffn_down", f"blk.{moe}.ffn_down_shexp", f"blk.{moe}.attn_output", "output"):
        assert f"{name}.weight" in expected
    assert len(expected) == 2 * 12 + 7 + 1
    _check_values(target, expected)
    assert report["imatrix"]["layers"] == [0, 1, 2] and report["imatrix"]["output"]


def _converter() -> bool:
    try:
        find_converter(None)
    except UserInputError:
        return False
    return True


def _imatrix_and_bf16_gguf(source: Path, directory: Path) -> tuple[Path, Path]:
    """The importance matrix that an MXFP4 quantisation of ``source`` writes, and ``source`` exported as a bf16 GGUF
    (both in ``directory``)."""
    target = directory / "x.imatrix"
    config = QuantizeConfig(scheme="mxfp4", imatrix_out=str(target))
    quantize_checkpoint(source, directory / "q", config, calib_tokens=TOKENS, seq_len=SEQ_LEN, progress=False)
    model = directory / "bf16.gguf"
    exported = run_cli("export", str(source), "--format", "gguf", "--out", str(model))
    assert exported.returncode == 0, exported.stderr
    return target, model


@pytest.mark.skipif(not _converter(), reason="MOECOMPRESS_LLAMA_CPP names no llama.cpp converter")
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "olmoe", "mixtral"])
def test_entries_are_the_converters_matrices(tmp_path, monkeypatch, family):
    """Each entry names a matrix of the GGUF llama.cpp's converter writes for the same checkpoint, with its input
    width (and expert count); every matrix but the token embedding has an entry."""
    if family == "qwen2_moe":
        source = _qwen2(tmp_path / family, monkeypatch, [])  # the converter maps no dense layer of qwen2moe
    else:
        source = save_tiny_source(family, tmp_path / family)
    target, model = _imatrix_and_bf16_gguf(source, tmp_path)
    _, weights = _read(model)
    _, entries = _read(target)
    names = {key.removesuffix(".in_sum2") for key in entries if key.endswith(".in_sum2")}
    matrices = {name for name, (shape, _, _) in weights.items() if len(shape) >= 2 and name != "token_embd.weight"}
    assert names == matrices
    for name in names:
        shape = weights[name][0]
        assert entries[f"{name}.in_sum2"][0] == [shape[0], *shape[2:]], name
    if family == "qwen2_moe":
        assert "blk.0.ffn_down_shexp.weight" in names
    assert ("output.weight" in names) == ("output.weight" in weights)


def test_pipeline_writes_the_pruned_blocks_statistics(tmp_path):
    """In a recipe the pass measures the block it quantises: after pruning, the kept experts."""
    target = tmp_path / "pruned.imatrix"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "calibration: {tokens: 512, seq_len: 128}\n"
        "passes:\n"
        "  - prune_experts: {method: frequency, ratio: 0.25}\n"
        f"  - quantize: {{scheme: mxfp4, imatrix_out: {target}}}\n"
    )
    result = run_cli("run", str(recipe), "--model", str(BUILTIN), "--out", str(tmp_path / "out"), "--quiet")
    assert result.returncode == 0, result.stderr
    _, tensors = _read(target)
    assert tensors["blk.0.ffn_down_exps.weight.in_sum2"][0] == [256, 6]
    assert tensors["blk.3.ffn_gate_exps.weight.counts"][1].sum() == 2 * 512


def test_a_killed_run_resumed_writes_the_same_file(tmp_path):
    """The layers a killed run wrote keep their saved sums; the resumed run adds the others."""
    command = [sys.executable, "-m", "moecompress.cli.main", "quantize", str(BUILTIN), "--scheme", "int4"]
    command += ["--method", "gptq", "--calib-tokens", str(TOKENS), "--seq-len", str(SEQ_LEN), "--no-eval", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def start(name: str, *extra: str) -> subprocess.Popen:
        out = [*command, "--out", str(tmp_path / name), "--imatrix-out", str(tmp_path / f"{name}.imatrix"), *extra]
        return subprocess.Popen(out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    reference = start("reference")
    assert reference.wait(timeout=600) == 0, reference.stderr.read()
    summary = f"importance matrix for llama-quantize: {tmp_path / 'reference.imatrix'} (4 layers: "
    assert summary in reference.stdout.read()
    saved = tmp_path / ".killed.run" / ".step-0.incomplete" / "state" / "imatrix" / "layer-1.safetensors"
    killed = start("killed")
    deadline = time.monotonic() + 600
    while not saved.exists() and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert killed.poll() is None, "the run finished before the kill point"
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert not (tmp_path / "killed.imatrix").exists()
    resumed = start("killed", "--resume")
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()
    assert (tmp_path / "killed.imatrix").read_bytes() == (tmp_path / "reference.imatrix").read_bytes()


@pytest.mark.parametrize(
    "where, message",
    [
        ("missing/x.imatrix", "does not exist"),
        ("out/x.imatrix", "inside the output directory"),
        ("model/x.imatrix", "inside the input"),
        (".", "a directory"),
    ],
)
def test_bad_targets_are_refused_before_any_work(tmp_path, where, message):
    model = tmp_path / "model"
    model.symlink_to(BUILTIN, target_is_directory=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "moecompress_report.json").write_text("{}")
    result = run_cli(
        "quantize", str(model), "--out", str(tmp_path / "out"), "--overwrite", "--imatrix-out", str(tmp_path / where)
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--imatrix-out" in lines[0] and message in lines[0], result.stderr
    assert not (tmp_path / "out" / "config.json").exists()


def test_a_family_without_a_known_llama_cpp_naming_is_refused(tmp_path):
    source = save_tiny_source("deepseek_v3", tmp_path / "ds")
    config = QuantizeConfig(scheme="mxfp4", imatrix_out=str(tmp_path / "ds.imatrix"))
    with pytest.raises(UserInputError, match=r"qwen3_moe.*not deepseek_v3"):
        quantize_checkpoint(source, tmp_path / "q", config, calib_tokens=TOKENS, seq_len=SEQ_LEN, progress=False)
    assert not (tmp_path / "q").exists()


def _binaries() -> Path | None:
    directory = os.environ.get("MOECOMPRESS_LLAMA_CPP_BIN")
    if not directory or not (Path(directory) / "llama-quantize").is_file() or not _converter():
        return None
    return Path(directory)


@pytest.mark.skipif(_binaries() is None, reason="MOECOMPRESS_LLAMA_CPP_BIN names no llama-quantize (or no converter)")
def test_llama_quantize_uses_the_importance_matrix(tmp_path):
    target, model = _imatrix_and_bf16_gguf(BUILTIN, tmp_path)
    result = subprocess.run(
        [_binaries() / "llama-quantize", "--imatrix", target, model, tmp_path / "q4km.gguf", "Q4_K_M", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert f"loaded 32 importance matrix entries from {target} computed on {TOKENS // SEQ_LEN} chunks" in log
    assert "imatrix datasets=['builtin:prose']" in log
    assert "did not find weights for blk." not in log
    fields, _ = _read(tmp_path / "q4km.gguf")
    assert fields["quantize.imatrix.entries_count"] == 32
