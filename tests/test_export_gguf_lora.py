"""Low-rank adapters exported as a llama.cpp LoRA adapter file beside the GGUF (issue 39 item 5). The adapter file is
checked with the gguf package alone; the export through llama.cpp's converter when MOECOMPRESS_LLAMA_CPP names one;
llama.cpp's perplexity with the adapters against the plugin's when MOECOMPRESS_LLAMA_CPP_BIN names a directory
holding a built ``llama-perplexity`` (otherwise those tests skip)."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import gguf
import pytest
import torch
from helpers import run_cli
from safetensors.torch import load_file, save_file

import moecompress
from moecompress.checkpoint import CheckpointReader
from moecompress.errors import UserInputError
from moecompress.export import converter_scope, gguf_lora
from moecompress.export.gguf_retype import Request
from moecompress.export.gguf_types import parse_pins
from moecompress.export.llama_cpp import find_converter
from moecompress.export.source import NativeSource
from moecompress.export.to_gguf import export_gguf
from moecompress.families import adapter_for
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint

BUILTIN = Path(moecompress.__file__).parent / "assets" / "tiny-moe"
BIN_VAR = "MOECOMPRESS_LLAMA_CPP_BIN"


def _converter() -> Path | None:
    try:
        return find_converter(None)
    except UserInputError:
        return None


def _perplexity_binary() -> Path | None:
    directory = os.environ.get(BIN_VAR)
    binary = Path(directory) / "llama-perplexity" if directory else None
    return binary if binary is not None and binary.is_file() else None


needs_converter = pytest.mark.skipif(_converter() is None, reason="MOECOMPRESS_LLAMA_CPP names no converter")


@pytest.fixture(scope="module")
def lowrank(tmp_path_factory):
    """``moecompress quantize builtin:tiny-moe --scheme mxfp4 --lowrank-budget 0.375``: MXFP4 experts with
    load-aware adapters (ranks differ per expert, some experts have none)."""
    out = tmp_path_factory.mktemp("lowrank") / "mxfp4-lowrank"
    quantize_checkpoint(BUILTIN, out, QuantizeConfig(scheme="mxfp4", lowrank_budget=0.375), progress=False)
    return out


def _without_adapters(source: Path, out: Path) -> Path:
    """``source`` with its adapter tensors and ranks removed: the same checkpoint, quantised the same, no adapters."""
    shutil.copytree(source, out)
    tensors = load_file(out / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".lowrank." not in k}, out / "model.safetensors", {"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]["lowrank"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def _check_adapter_file(path: Path, source: Path, arch: str) -> None:
    """Metadata, names and shapes of the LoRA file, and per expert A = R and B = L (padded with zeros), so that
    B·A = L·R for every expert."""
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["general.architecture"].contents() == arch
    assert reader.fields["adapter.type"].contents() == "lora"
    assert reader.fields["adapter.lora.alpha"].contents() == 0.0
    tensors = {t.name: t for t in reader.tensors}
    with CheckpointReader(source) as checkpoint:
        lowrank = checkpoint.config["quantization_config"]["lowrank"]
        wanted = set()
        padded = 0
        for module, ranks in lowrank.items():
            layer = int(module.split(".")[2])
            for matrix, per_expert in ranks.items():
                if not any(per_expert):
                    continue
                base = f"blk.{layer}.ffn_{matrix}_exps.weight"
                wanted |= {f"{base}.lora_a", f"{base}.lora_b"}
                a, b = tensors[f"{base}.lora_a"], tensors[f"{base}.lora_b"]
                assert a.tensor_type.name == b.tensor_type.name == "BF16"
                experts, rank = len(per_expert), max(per_expert)
                hidden, inter = checkpoint.config["hidden_size"], checkpoint.config["moe_intermediate_size"]
                rows, cols = (hidden, inter) if matrix == "down" else (inter, hidden)
                assert (tuple(a.shape), tuple(b.shape)) == ((cols, rank, experts), (rank, rows, experts))  # GGML order
                a = torch.from_numpy(gguf.quants.dequantize(a.data, a.tensor_type)).reshape(experts, rank, cols)
                b = torch.from_numpy(gguf.quants.dequantize(b.data, b.tensor_type)).reshape(experts, rows, rank)
                for expert, r in enumerate(per_expert):
                    padded += r < rank
                    assert not a[expert, r:].any() and not b[expert, :, r:].any()
                    if not r:
                        continue
                    left = checkpoint.tensor(f"{module}.lowrank.{expert}.{matrix}_L").float()
                    right = checkpoint.tensor(f"{module}.lowrank.{expert}.{matrix}_R").float()
                    assert torch.equal(a[expert, :r], right) and torch.equal(b[expert, :, :r], left)
                    assert torch.allclose(b[expert] @ a[expert], left @ right, rtol=0, atol=1e-6)
    assert set(tensors) == wanted
    assert padded > 0


def test_the_adapter_file_holds_every_experts_l_and_r_padded_with_zeros(lowrank, tmp_path):
    """Written by the gguf package alone (no converter): the adapter GGUF reads back with llama.cpp's names,
    shapes and metadata, and B·A is our L·R for every expert."""
    with CheckpointReader(lowrank) as reader:
        native = NativeSource(reader, adapter_for(reader.config))
        tensors = gguf_lora.plan(native, lowrank)
        assert {entry.rank for entry in tensors} != {1} and len({entry.rank for entry in tensors}) > 1
        gguf_lora.write_lora(native, tensors, "qwen3moe", tmp_path / "a.gguf", progress=False)
    _check_adapter_file(tmp_path / "a.gguf", lowrank, "qwen3moe")


def test_a_config_naming_adapters_the_checkpoint_lacks_is_refused_with_one_line(lowrank, tmp_path):
    source = _without_adapters(lowrank, tmp_path / "no-tensors")
    config = json.loads((lowrank / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(config))
    done = run_cli("export", str(source), "--format", "gguf", "--out", str(tmp_path / "x.gguf"))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "lowrank" in done.stderr and "missing" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-tensors"]


@pytest.mark.parametrize(
    ("extra", "without_adapters", "message"),
    [
        (["--fold"], False, "--fold folds the adapters"),
        ([], True, "has no low-rank adapters"),
    ],
)
def test_lora_out_where_there_is_nothing_for_it_is_refused(lowrank, tmp_path, extra, without_adapters, message):
    source = _without_adapters(lowrank, tmp_path / "plain") if without_adapters else lowrank
    out = tmp_path / "x.gguf"
    done = run_cli("export", str(source), "--format", "gguf", "--out", str(out), "--lora-out", "a.gguf", *extra)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and message in done.stderr
    assert not out.exists()


def test_an_existing_lora_file_is_refused_before_any_work(lowrank, tmp_path):
    (tmp_path / "x.lora.gguf").write_text("keep")
    done = run_cli("export", str(lowrank), "--format", "gguf", "--out", str(tmp_path / "x.gguf"))
    assert done.returncode == 2 and "--overwrite" in done.stderr and done.stderr.count("\n") == 1
    assert (tmp_path / "x.lora.gguf").read_text() == "keep" and not (tmp_path / "x.gguf").exists()


@needs_converter
def test_the_base_gguf_is_the_export_without_adapters_and_the_lora_file_sits_beside_it(lowrank, tmp_path):
    report = export_gguf(lowrank, tmp_path / "model.gguf", progress=False)
    lora = tmp_path / "model.lora.gguf"
    assert report["lora"]["path"] == str(lora) and report["lora"]["bytes"] == lora.stat().st_size
    assert report["experts"]["written_as"] == ["MXFP4"] and report["experts"]["all_exact"]
    assert json.loads((tmp_path / "model.gguf.report.json").read_text())["lora"]["path"] == str(lora)
    export_gguf(_without_adapters(lowrank, tmp_path / "plain"), tmp_path / "plain.gguf", progress=False)
    assert (tmp_path / "model.gguf").read_bytes() == (tmp_path / "plain.gguf").read_bytes()
    assert not (tmp_path / "plain.lora.gguf").exists()
    arch = gguf.GGUFReader(tmp_path / "model.gguf").fields["general.architecture"].contents()
    _check_adapter_file(lora, lowrank, arch)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@needs_converter
@pytest.mark.parametrize("in_process", [True, False])
def test_relative_paths_for_the_input_the_output_and_the_lora_file(lowrank, tmp_path, monkeypatch, in_process):
    """Issue 39: the converter, in our process or its own (which runs in a directory of its own), gets paths that
    name the same places as the relative ones given."""
    shutil.copytree(lowrank, tmp_path / "in")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    if not in_process:
        monkeypatch.setattr(converter_scope, "usable", lambda: False)
    report = export_gguf(Path("../in"), Path("out.gguf"), lora_out=Path("../a.gguf"), progress=False)
    assert (tmp_path / "sub" / "out.gguf").stat().st_size == report["bytes"]
    assert report["lora"]["path"] == str(tmp_path / "a.gguf")
    _check_adapter_file(tmp_path / "a.gguf", lowrank, "qwen3moe")


@needs_converter
def test_the_cli_names_both_files(lowrank, tmp_path, monkeypatch):
    shutil.copytree(lowrank, tmp_path / "in")
    monkeypatch.chdir(tmp_path)
    done = run_cli("export", "in", "--format", "gguf", "--out", "m.gguf", "--quiet")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("wrote m.gguf (") and "MXFP4 (exact)" in lines[0]
    lora = tmp_path / "m.lora.gguf"
    assert lines[1].startswith("other tensors: ") and "Q8_0" in lines[1]
    assert lines[2].startswith(f"wrote {lora} (") and f"-m m.gguf --lora {lora}" in lines[2]
    assert (tmp_path / "m.gguf").is_file() and (tmp_path / "m.lora.gguf").is_file()


WINDOW, STRIDE = 256, 255


def _llama_perplexity(binary: Path, data: Path, *models: str) -> tuple[float, int, int]:
    """``llama-perplexity -c 129 -b 129 --ppl-stride 255``: it grows the context to 256 and scores windows
    ``[255 i, 255 i + 256)`` (docs/llama_cpp.md). Returns the perplexity, the tokens it read and the windows."""
    command = [str(binary), *models, "-f", str(data), "-c", "129", "-b", "129", "--ppl-stride", str(STRIDE), "-t", "1"]
    command.append("--no-repack")  # this llama.cpp's CPU weight repacking crashes on some small tensors
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-2000:]
    assert int(re.search(r"n_ctx=(\d+)", text).group(1)) == WINDOW
    chunks = re.findall(r"\[(\d+)\]([0-9.]+),", text)
    tokens = int(re.search(r"have (\d+) tokens", text).group(1))
    return float(chunks[-1][1]), tokens, int(chunks[-1][0])


@pytest.mark.skipif(
    _perplexity_binary() is None or _converter() is None,
    reason=f"{BIN_VAR} names no built llama-perplexity (or no converter)",
)
def test_llama_cpp_with_the_lora_file_scores_what_the_plugin_scores(lowrank, tmp_path):
    """On the same windows of the same tokens (builtin:prose held-out, 129 windows of 256): llama.cpp running the
    base GGUF with ``--lora`` against ``moecompress eval``'s evaluation of the native checkpoint (transformers with
    the plugin, float32), within 0.1%; the adapters move llama.cpp's perplexity by more than that."""
    from transformers import AutoTokenizer

    from moecompress.calibration.batches import TokenWindows
    from moecompress.calibration.builtin_corpus import builtin_documents
    from moecompress.evals.perplexity import evaluate_windows
    from moecompress.loading import load_adapter, load_model

    data = tmp_path / "heldout.txt"
    text = "\n\n".join(doc.text for doc in builtin_documents("prose", "heldout")).rstrip("\n")
    data.write_text(text)  # llama-perplexity drops a trailing newline: there is none
    keep = Request(pins=parse_pins([".=keep"]))  # the plugin runs attention and embeddings in bf16
    report = export_gguf(lowrank, tmp_path / "base.gguf", types=keep, progress=False)
    binary, base, lora = _perplexity_binary(), str(tmp_path / "base.gguf"), report["lora"]["path"]
    llama, read, windows = _llama_perplexity(binary, data, "-m", base, "--lora", lora)
    llama_base, _, _ = _llama_perplexity(binary, data, "-m", base)
    ids = AutoTokenizer.from_pretrained(lowrank)(text, add_special_tokens=False)["input_ids"]
    assert read == len(ids) and windows == (len(ids) - WINDOW + STRIDE - 1) // STRIDE == 129  # no BOS added
    ids = torch.tensor(ids)
    batch = torch.stack([ids[i * STRIDE : i * STRIDE + WINDOW] for i in range(windows)])
    adapter = load_adapter(lowrank)
    model = load_model(lowrank, adapter)
    ours = evaluate_windows(model, adapter, TokenWindows(batch, torch.zeros_like(batch), ["text"]), progress=False)
    ours = float(ours.perplexity)
    print(f"llama.cpp --lora {llama:.4f}, without {llama_base:.4f}; plugin {ours:.4f} ({windows} windows)")
    assert abs(llama - ours) / ours < 1e-3, (llama, ours)
    assert abs(llama - llama_base) / llama_base > 3e-3, (llama, llama_base)
