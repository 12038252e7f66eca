"""GGUF and bf16 export. The block writer and the GGUF container are tested with the gguf package alone; the
converter-driven export runs when MOECOMPRESS_LLAMA_CPP names a llama.cpp checkout or an unpacked
llama-cpp-python sdist (otherwise those tests skip), and the tokenisation test when MOECOMPRESS_LLAMA_CPP_BIN names
a directory holding a built ``llama-tokenize``."""

import inspect
import json
import os
import resource
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import run_cli
from synthetic import tiny_tokenizer

import moecompress
from moecompress.checkpoint import CheckpointReader, CheckpointWriter
from moecompress.errors import UserInputError
from moecompress.export import ggml_blocks
from moecompress.export.gguf_retype import Request
from moecompress.export.gguf_types import parse_pins
from moecompress.export.llama_cpp import ENV_VAR, find_converter, gpt2_compatible, run_converter
from moecompress.export.source import NativeSource, fold
from moecompress.export.to_bf16 import export_bf16
from moecompress.export.to_gguf import export_gguf, source_outtype
from moecompress.export.view import ConverterView
from moecompress.families import adapter_for
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint
from moecompress.quantization.scheme import QuantScheme
from moecompress.quantization.schemes.ggml_blocks import FORMATS

BUILTIN = Path(moecompress.__file__).parent / "assets" / "tiny-moe"
SCHEMES = {
    "mxfp4": QuantizeConfig(scheme="mxfp4"),
    "int4": QuantizeConfig(scheme="int4", group_size=32, symmetric=True),
    "int4-asym": QuantizeConfig(scheme="int4", group_size=32, symmetric=False),
}


def _converter() -> Path | None:
    try:
        return find_converter(None)
    except UserInputError:
        return None


needs_converter = pytest.mark.skipif(_converter() is None, reason=f"{ENV_VAR} names no llama.cpp converter")


def _weights(rows=96, cols=256, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(3, rows, cols, generator=generator) * 0.02
    weight[0, 0, :32] = 0.0  # an all-zero block
    weight[0, 1, :32] *= 1e-30  # scales far below fp16's range
    weight[1, 2, 32:64] *= 1e4  # and large ones
    return weight


def _bound(q, scheme_name):
    ours = q.dequantize()
    if q.zeros is None:
        return 2**-8 * ours.abs()
    m = (q.zeros.float() * q.scales.float()).repeat_interleave(q.scheme.group_size, dim=-1).reshape(ours.shape)
    return 2**-8 * ours.abs() + 2**-11 * m + 1e-12


@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_mxfp4_experts_become_ggml_mxfp4_blocks_that_dequantise_exactly(rule):
    q = QuantScheme("mxfp4", scale_rule=rule).quantize(_weights())
    blocks = ggml_blocks.to_ggml(q)
    assert blocks.type_name == "MXFP4"
    assert blocks.blocks.shape == (3, 96, 256 // 32 * 17)
    theirs = gguf.quants.dequantize(blocks.blocks, gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(theirs, q.dequantize().numpy())
    assert ggml_blocks.measure(q, blocks).exact
    # the layout: the scale byte first, then weight j in the low nibble and weight j + 16 in the high nibble
    codes = q.codes()[0, 5, :32]
    block = blocks.blocks[0, 5, :17]
    assert block[0] == q.scales[0, 5, 0]
    assert [int(b) & 15 for b in block[1:]] == codes[:16].tolist()
    assert [int(b) >> 4 for b in block[1:]] == codes[16:].tolist()


@pytest.mark.parametrize(
    ("scheme", "ggml_type", "exact"),
    [
        (QuantScheme("int4", 32, symmetric=True), "Q4_0", False),
        (QuantScheme("int4", 128, symmetric=True), "Q4_0", False),
        (QuantScheme("int4", 32, symmetric=False), "Q4_1", False),
        (QuantScheme("int2", 32, symmetric=True), "Q4_0", True),
        (QuantScheme("int2", 64, symmetric=False), "Q4_1", True),
        (QuantScheme("binary", 128), "Q4_0", True),
    ],
)
def test_integer_experts_become_q4_blocks_within_the_stated_bound(scheme, ggml_type, exact):
    weight = _weights()
    weight[0, 1, :] = torch.randn(256) * 0.02  # keep the scales within fp16's range here
    q = scheme.quantize(weight)
    blocks = ggml_blocks.to_ggml(q)
    assert blocks.type_name == ggml_type
    theirs = torch.from_numpy(gguf.quants.dequantize(blocks.blocks, gguf.GGMLQuantizationType[ggml_type]))
    ours = q.dequantize()
    assert ((theirs - ours).abs() <= _bound(q, scheme.name)).all()
    error = ggml_blocks.measure(q, blocks)
    assert error.exact == exact
    if not exact:
        assert 0 < error.max_rel <= 2**-8 + (2**-11 * 15 if ggml_type == "Q4_1" else 0)


@pytest.mark.parametrize(
    "scheme",
    [
        QuantScheme("mxfp4"),
        QuantScheme("mxfp4", scale_rule="ceil"),
        QuantScheme("int4", 32, symmetric=True),
        QuantScheme("int4", 32, symmetric=False),
        QuantScheme("int2", 32, symmetric=True),
        QuantScheme("int2", 64, symmetric=False),
        QuantScheme("binary", 128),
    ],
)
def test_measure_by_the_group_table_is_the_measure_of_every_weight(scheme):
    q = scheme.quantize(_weights(rows=512, cols=512))
    blocks = ggml_blocks.to_ggml(q)
    every_weight = ggml_blocks.compare(ggml_blocks.ggml_dequantize(blocks), q.dequantize())
    assert ggml_blocks.measure(q, blocks) == every_weight
    table = ggml_blocks._every_group(q)
    assert table is not None and table.numel < q.numel
    assert set(q.dequantize().unique().tolist()) <= set(table.dequantize().unique().tolist())


def test_4bit_blocks_repacked_from_the_stored_bytes_equal_those_from_the_codes():
    for scheme in (QuantScheme("mxfp4"), QuantScheme("int4", 32, symmetric=True), QuantScheme("int4", 64)):
        q = scheme.quantize(_weights())
        blocks = torch.from_numpy(ggml_blocks.to_ggml(q).blocks).reshape(3, 96, 8, -1)
        head = blocks.shape[-1] - 16
        assert torch.equal(blocks[..., head:], ggml_blocks._ggml_nibbles(q.codes()))
        half = ggml_blocks.to_ggml(
            replace(
                q,
                shape=(3, 48, 256),
                packed=q.packed[:, 48:],
                scales=q.scales[:, 48:],
                zeros=None if q.zeros is None else q.zeros[:, 48:],
            )
        )
        assert np.array_equal(half.blocks, blocks[:, 48:].reshape(3, 48, -1).numpy())


def test_salient_weights_have_no_ggml_block():
    weight = _weights()
    keep = torch.zeros_like(weight, dtype=torch.bool)
    keep[0, 0, 3] = True
    q = QuantScheme("int2").quantize(weight, keep)
    with pytest.raises(ValueError, match="salient"):
        ggml_blocks.to_ggml(q)


def test_the_converter_view_is_sharded_like_a_written_checkpoint_with_holes_for_the_experts(tmp_path):
    generator = torch.Generator().manual_seed(0)
    units = [
        {f"model.layers.{layer}.w{i}": torch.randn(128, 256, generator=generator).to(torch.bfloat16) for i in range(4)}
        for layer in range(3)
    ]
    holes = {"model.layers.0.w1", "model.layers.1.w0", "model.layers.1.w3", "model.layers.2.w2"}
    side = tmp_path / "side"
    side.mkdir()
    (side / "tokenizer.json").write_text("{}")
    (side / "model.safetensors").write_bytes(b"not copied")
    shard_bytes = 3 * 128 * 256 * 2
    writer = CheckpointWriter(tmp_path / "full", max_shard_bytes=shard_bytes)
    view = ConverterView(tmp_path / "view", max_shard_bytes=shard_bytes)
    for unit in units:
        writer.add(unit)
        view.add({k: torch.empty(t.shape, dtype=t.dtype, device="meta") if k in holes else t for k, t in unit.items()})
    writer.finish({"architectures": ["X"]})
    view.finish({"architectures": ["X"]}, side)
    index = "model.safetensors.index.json"
    weight_map = json.loads((tmp_path / "view" / index).read_text())["weight_map"]
    assert weight_map == json.loads((tmp_path / "full" / index).read_text())["weight_map"]
    assert sorted(p.name for p in (tmp_path / "view").iterdir()) == sorted(
        [index, "config.json", "tokenizer.json", *set(weight_map.values())]
    )
    with CheckpointReader(tmp_path / "view") as reader:
        for unit in units:
            for key, tensor in unit.items():
                assert torch.equal(reader.tensor(key), torch.zeros_like(tensor) if key in holes else tensor)
    for name in set(weight_map.values()):
        stat = (tmp_path / "view" / name).stat()
        held = [k for k, file in weight_map.items() if file == name and k not in holes]
        assert stat.st_blocks * 512 < stat.st_size or len(held) == sum(v == name for v in weight_map.values())


@pytest.fixture(scope="module")
def native_outputs(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    tokenizer = tiny_tokenizer()
    out = {}
    for family in ("qwen3_moe", "mixtral"):
        for name, config in SCHEMES.items():
            if family == "mixtral" and name == "int4-asym":
                continue
            path = root / f"{family}-{name}"
            quantize_checkpoint(tiny_checkpoints[family], path, config, progress=False)
            tokenizer.save_pretrained(path)
            out[(family, name)] = path
    return out


def _plugin_experts(directory: Path) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE layer, the stacked dequantised gate_up and down the plugin-loaded model computes with."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    adapter = adapter_for(json.loads((directory / "config.json").read_text()))
    out = {}
    for layer in adapter.moe_layers():
        experts = adapter.experts_of(model, layer)
        pairs = [experts.expert_weights(e, torch.float32) for e in range(experts.num_experts)]
        out[layer] = (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))
    return out


def _expected(experts, layer, matrix):
    gate_up, down = experts[layer]
    inter = down.shape[-1]
    return {"gate": gate_up[:, :inter], "up": gate_up[:, inter:], "down": down}[matrix]


def _gguf_expert_matrices(layer) -> dict:
    """A native layer's quantised experts as GGUF's three expert matrices: the gate and up halves of ``gate_up``'s
    rows, and ``down``."""
    inter = layer.moe.intermediate_size
    rows = torch.arange(2 * inter)
    return {
        "gate": layer.gate_up_q.take_rows(rows[:inter]),
        "up": layer.gate_up_q.take_rows(rows[inter:]),
        "down": layer.down_q,
    }


def _check_gguf_experts(path: Path, experts, exact: bool) -> set[str]:
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    kinds = set()
    for layer in experts:
        for matrix in ("gate", "up", "down"):
            tensor = tensors[f"blk.{layer}.ffn_{matrix}_exps.weight"]
            kinds.add(tensor.tensor_type.name)
            want = _expected(experts, layer, matrix)
            got = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).reshape(want.shape)
            if exact:
                assert torch.equal(got, want), f"layer {layer} {matrix}"
            else:
                assert ((got - want).abs() <= 2**-8 * want.abs() + 2**-11 * 15 * want.abs().amax()).all()
    return kinds


@pytest.mark.parametrize(("family", "name"), [("qwen3_moe", "mxfp4"), ("mixtral", "mxfp4"), ("qwen3_moe", "int4")])
def test_expert_blocks_in_a_gguf_file_read_back_as_our_weights_without_a_converter(
    native_outputs, tmp_path, family, name
):
    """Our blocks in a GGUF container written by the gguf package itself: the path that needs no llama.cpp."""
    directory = native_outputs[(family, name)]
    path = tmp_path / "experts.gguf"
    writer = gguf.GGUFWriter(path, "test")
    with CheckpointReader(directory) as reader:
        source = NativeSource(reader, adapter_for(reader.config))
        for layer in source.iter_layers():
            if layer.gate_up_q is None:
                continue
            for matrix, q in _gguf_expert_matrices(layer).items():
                blocks = ggml_blocks.to_ggml(q)
                writer.add_tensor(
                    f"blk.{layer.layer}.ffn_{matrix}_exps.weight",
                    blocks.blocks,
                    raw_dtype=gguf.GGMLQuantizationType[blocks.type_name],
                )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    kinds = _check_gguf_experts(path, _plugin_experts(directory), exact=name == "mxfp4")
    assert kinds == {"MXFP4" if name == "mxfp4" else "Q4_0"}


def test_bf16_export_is_the_dequantised_model_in_stock_transformers(native_outputs, tmp_path):
    from transformers import AutoModelForCausalLM

    directory = native_outputs[("qwen3_moe", "int4-asym")]
    report = export_bf16(directory, tmp_path / "bf16", progress=False)
    assert report["folded"]["layers"] == {}
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in config
    with CheckpointReader(tmp_path / "bf16") as reader:
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in reader.keys()
        assert all(reader.tensors[k].dtype in ("BF16", "F32") for k in reader.keys())
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    quantized = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    adapter = adapter_for(config)
    expected = _plugin_experts(directory)
    for layer in adapter.moe_layers():
        experts = adapter.experts_of(plain, layer)
        assert torch.equal(experts.gate_up_proj.float(), expected[layer][0])
        assert torch.equal(experts.down_proj.float(), expected[layer][1])
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, quantized(input_ids=ids).logits, atol=2e-2, rtol=0)


def test_fold_adds_each_adapter_to_its_rows():
    from moecompress.export.source import SourceLayer
    from moecompress.families import MoEWeights

    weight = torch.randn(2, 64, 32) * 0.02
    down_w = torch.randn(2, 32, 32) * 0.02
    q_gate_up, q_down = QuantScheme("int4").quantize(weight), QuantScheme("int4").quantize(down_w)
    moe = MoEWeights(router_weight=torch.zeros(2, 32), gate_up=weight, down=down_w)
    left, right = torch.randn(32, 2), torch.randn(2, 32)
    layer = SourceLayer(0, moe, {}, q_gate_up, q_down, {(1, "up"): (left, right)})
    folded = fold(layer)
    assert set(folded) == {"gate_up"}
    expected = q_gate_up.dequantize()
    expected[1, 32:] += left @ right
    assert torch.equal(folded["gate_up"], expected)


def test_global_scope_output_is_refused_naming_scope_layer(tiny_with_tokenizer, tmp_path):
    from moecompress.passes.prune_experts import PruneExpertsConfig, prune_experts

    out = tmp_path / "global"
    config = PruneExpertsConfig(method="frequency", ratio=0.5, scope="global")
    prune_experts(tiny_with_tokenizer["qwen3_moe"], out, config, calib_tokens=2048, seq_len=64, progress=False)
    counts = json.loads((out / "config.json").read_text())["moecompress"]["experts_per_layer"]
    assert len(set(counts.values())) > 1
    result = run_cli("export", str(out), "--format", "gguf", "--out", str(tmp_path / "x.gguf"), env={ENV_VAR: ""})
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--scope layer" in result.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_salient_weights_are_refused_without_fold(native_outputs, tmp_path):
    """Adapters go to a LoRA file (tests/test_export_gguf_lora.py); salient weights have no GGML form."""
    directory = tmp_path / "with-salient"
    shutil.copytree(native_outputs[("qwen3_moe", "mxfp4")], directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["salient"] = {"model.layers.0.mlp.experts": {"down_proj": [16, 4]}}
    (directory / "config.json").write_text(json.dumps(config))
    result = run_cli("export", str(directory), "--format", "gguf", "--out", str(tmp_path / "x.gguf"))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--fold" in result.stderr and "salient weights" in result.stderr


def test_missing_converter_is_refused_with_one_line(native_outputs, tmp_path):
    env = {ENV_VAR: ""}
    result = run_cli(
        "export",
        str(native_outputs[("qwen3_moe", "mxfp4")]),
        "--format",
        "gguf",
        "--out",
        str(tmp_path / "x.gguf"),
        env=env,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--llama-cpp" in result.stderr


def test_builtin_tokenizer_is_a_gpt2_byte_level_bpe(tmp_path):
    assert gpt2_compatible(BUILTIN / "tokenizer.json")
    data = json.loads((BUILTIN / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "Split"}, data["pre_tokenizer"]]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    assert not gpt2_compatible(tmp_path / "tokenizer.json")


@needs_converter
@pytest.mark.parametrize(
    ("family", "name"), [("qwen3_moe", "mxfp4"), ("qwen3_moe", "int4"), ("mixtral", "mxfp4"), ("mixtral", "int4")]
)
def test_gguf_export_keeps_our_expert_codes(native_outputs, tmp_path, family, name):
    directory = native_outputs[(family, name)]
    out = tmp_path / "model.gguf"
    report = export_gguf(directory, out, progress=False)
    kind = "MXFP4" if name == "mxfp4" else "Q4_0"
    assert report["experts"]["written_as"] == [kind]
    assert report["experts"]["all_exact"] == (name == "mxfp4")
    assert json.loads((tmp_path / "model.gguf.report.json").read_text())["bytes"] == out.stat().st_size
    assert _check_gguf_experts(out, _plugin_experts(directory), exact=name == "mxfp4") == {kind}
    reader = gguf.GGUFReader(out)
    assert reader.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    file_type = gguf.LlamaFileType.MOSTLY_MXFP4_MOE if name == "mxfp4" else gguf.LlamaFileType.MOSTLY_Q4_0
    assert reader.fields["general.file_type"].contents() == file_type
    with CheckpointReader(directory) as source:
        embed = source.tensor("model.embed_tokens.weight")
    token_embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert token_embd.tensor_type.name == "Q8_0"  # --base-type's default for the tensors our pass left alone
    got = torch.from_numpy(gguf.quants.dequantize(token_embd.data, token_embd.tensor_type)).reshape(embed.shape)
    q8 = FORMATS["Q8_0"]
    rows = embed.float().reshape(-1, q8.block)
    assert torch.equal(got, q8.decode(q8.encode(rows, torch.ones_like(rows))).reshape(embed.shape))
    kept = export_gguf(directory, tmp_path / "kept.gguf", types=Request(pins=parse_pins([".=keep"])), progress=False)
    assert kept["tensor_types"]["tensors"]["token_embd.weight"]["why"] == "pinned: keep"
    token_embd = next(t for t in gguf.GGUFReader(tmp_path / "kept.gguf").tensors if t.name == "token_embd.weight")
    got = torch.from_numpy(gguf.quants.dequantize(token_embd.data, token_embd.tensor_type)).reshape(embed.shape)
    assert torch.equal(got, embed.float())


@needs_converter
@pytest.mark.parametrize("name", ["mxfp4", "int4-asym"])
def test_holes_for_the_experts_give_the_file_a_whole_dequantised_view_gives(native_outputs, tmp_path, name):
    """The converter reading a view whose experts are holes writes what it writes from the whole dequantised view
    (the export before the holes): the same metadata, tensors in the same order, the same non-expert bytes; only
    the experts differ, ours in place of the converter's bf16."""
    directory = native_outputs[("qwen3_moe", name)]
    export_gguf(directory, tmp_path / "ours.gguf", types=KEEP_OTHERS, progress=False)
    export_bf16(directory, tmp_path / "view", progress=False)
    with CheckpointReader(directory) as reader:
        outtype = source_outtype(reader)
    run_converter(find_converter(None), tmp_path / "view", tmp_path / "whole.gguf", outtype=outtype)
    ours, whole = gguf.GGUFReader(tmp_path / "ours.gguf"), gguf.GGUFReader(tmp_path / "whole.gguf")
    assert list(ours.fields) == list(whole.fields)
    for key, field in ours.fields.items():
        if key != "general.file_type" and not key.startswith("GGUF."):
            assert field.contents() == whole.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in whole.tensors]
    experts = 0
    for mine, theirs in zip(ours.tensors, whole.tensors, strict=True):
        if "_exps." in mine.name:
            assert mine.tensor_type.name == ("MXFP4" if name == "mxfp4" else "Q4_1")
            experts += 1
        else:
            assert mine.tensor_type == theirs.tensor_type
            assert mine.data.tobytes() == theirs.data.tobytes(), mine.name
    assert experts > 0


@needs_converter
def test_a_file_size_limit_while_exporting_is_one_line_naming_the_output(native_outputs, tmp_path):
    """The view (whose holes still count towards a file's size) and the expert blocks are written by us: a full disk
    there is one line naming the GGUF file, and nothing is left behind."""
    entry = "import signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_DFL); sys.argv[0] = 'moecompress'; "
    entry += "from moecompress.cli.main import main; main()"
    out = tmp_path / "model.gguf"
    argv = [sys.executable, "-c", entry, "export", str(native_outputs[("qwen3_moe", "mxfp4")]), "--format", "gguf"]

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))  # the view's first shard is larger

    done = subprocess.run([*argv, "--out", str(out)], capture_output=True, text=True, preexec_fn=limited)
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"file-size limit reached writing {out}" in lines[0], done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@needs_converter
def test_a_relative_path_to_an_unquantised_checkpoint_converts(tmp_path, monkeypatch):
    """Issue 39: the converter runs in a directory of its own, where a relative path named nothing."""
    shutil.copytree(BUILTIN, tmp_path / "big1")
    monkeypatch.chdir(tmp_path)
    done = run_cli("export", "big1", "--format", "gguf", "--out", "big1.gguf", "--quiet")
    assert done.returncode == 0, done.stderr
    reader = gguf.GGUFReader(tmp_path / "big1.gguf")
    assert any(t.name == "blk.0.ffn_up_exps.weight" for t in reader.tensors)


@needs_converter
def test_a_relative_path_converts_in_the_converters_own_process_too(tmp_path, monkeypatch):
    """The subprocess route (taken where the converter cannot run in our process) runs in a directory of its own:
    the input and output given relative to ours still name the same places."""
    from moecompress.export import converter_scope

    shutil.copytree(BUILTIN, tmp_path / "big1")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    monkeypatch.setattr(converter_scope, "usable", lambda: False)
    report = export_gguf(Path("../big1"), Path("big1.gguf"), progress=False)
    assert (tmp_path / "sub" / "big1.gguf").stat().st_size == report["bytes"]
    reader = gguf.GGUFReader(tmp_path / "sub" / "big1.gguf")
    assert any(t.name == "blk.0.ffn_up_exps.weight" for t in reader.tensors)


@needs_converter
def test_builtin_model_converts_with_the_gpt2_pre_tokenizer(tmp_path):
    report = export_gguf(BUILTIN, tmp_path / "tiny.gguf", progress=False)
    assert report["pre_tokenizer_fallback"] == "gpt-2"
    reader = gguf.GGUFReader(tmp_path / "tiny.gguf")
    assert reader.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    with CheckpointReader(BUILTIN) as source:
        want = source.tensor("model.layers.1.mlp.experts.5.up_proj.weight").float()
    tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_up_exps.weight")
    got = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    assert torch.equal(got.reshape(-1, *want.shape)[5], want)


@pytest.mark.skipif(
    not (os.environ.get("MOECOMPRESS_LLAMA_CPP_BIN") and _converter()),
    reason="MOECOMPRESS_LLAMA_CPP_BIN names no built llama-tokenize (or no converter)",
)
def test_llama_cpp_tokenises_the_builtin_model_like_transformers(tmp_path):
    from transformers import AutoTokenizer

    from moecompress.calibration.builtin_corpus import builtin_documents

    export_gguf(BUILTIN, tmp_path / "tiny.gguf", progress=False)
    tokenizer = AutoTokenizer.from_pretrained(BUILTIN)
    binary = Path(os.environ["MOECOMPRESS_LLAMA_CPP_BIN"]) / "llama-tokenize"
    texts = [doc.text for doc in builtin_documents("prose", "heldout")[:3]] + [
        doc.text for doc in builtin_documents("code", "heldout")[:2]
    ]
    texts.append("I've been 'told he's there, 'RE you sure?  3.14  \t\n\n  ünïcödé 🦙 x")
    for text in texts:
        text = text[:4000]
        (tmp_path / "t.txt").write_text(text)
        done = subprocess.run(
            [
                str(binary),
                "-m",
                str(tmp_path / "tiny.gguf"),
                "-f",
                str(tmp_path / "t.txt"),
                "--ids",
                "--log-disable",
                "--no-bos",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        ids = json.loads(done.stdout.strip().splitlines()[-1])
        assert ids == tokenizer.encode(text, add_special_tokens=False)


@needs_converter
def test_fold_writes_adapted_layers_dense_and_the_rest_as_blocks(tiny_with_tokenizer, tmp_path):
    source = tmp_path / "lowrank"
    config = QuantizeConfig(scheme="mxfp4", lowrank_budget=0.5)
    quantize_checkpoint(tiny_with_tokenizer["qwen3_moe"], source, config, calib_tokens=2048, seq_len=64, progress=False)
    lowrank = json.loads((source / "config.json").read_text())["quantization_config"]["lowrank"]
    assert lowrank
    report = export_gguf(source, tmp_path / "folded.gguf", fold=True, progress=False)
    assert report["folded"]["what"] == ["lowrank"]
    reader = gguf.GGUFReader(tmp_path / "folded.gguf")
    tensors = {t.name: t for t in reader.tensors}
    with CheckpointReader(source) as checkpoint:
        native = NativeSource(checkpoint, adapter_for(checkpoint.config))
        for layer in native.iter_layers():
            folded = fold(layer)
            assert sorted(folded) == report["folded"]["layers"].get(str(layer.layer), [])
            inter = layer.moe.intermediate_size
            for matrix in ("gate", "up", "down"):
                tensor = tensors[f"blk.{layer.layer}.ffn_{matrix}_exps.weight"]
                whole = "down" if matrix == "down" else "gate_up"
                got = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
                if whole in folded:
                    assert tensor.tensor_type.name in ("BF16", "F32")  # the converter's outtype: the source's
                    rows = {"gate": slice(0, inter), "up": slice(inter, None), "down": slice(None)}[matrix]
                    want = folded[whole][:, rows].to(torch.bfloat16).float()
                    assert torch.equal(got.reshape(want.shape), want)
                else:
                    assert tensor.tensor_type.name == "MXFP4"


@needs_converter
def test_gpt_oss_export_converts_to_the_same_mxfp4_values(tiny_with_tokenizer, tmp_path):
    """Our --format gpt-oss output goes to the converter as it is; llama.cpp's own MXFP4 repacking keeps our values."""
    source = tiny_with_tokenizer["gpt_oss"]
    quantize_checkpoint(source, tmp_path / "native", QuantizeConfig(), progress=False)
    quantize_checkpoint(source, tmp_path / "export", QuantizeConfig(format="gpt-oss"), progress=False)
    export_gguf(tmp_path / "export", tmp_path / "gpt-oss.gguf", progress=False)
    assert _check_gguf_experts(tmp_path / "gpt-oss.gguf", _plugin_experts(tmp_path / "native"), exact=True) == {"MXFP4"}


def _torch_to_ggml(q):
    """The re-pack before the numpy one (torch, whole tensor at once): the vectorised one must give its bytes."""
    type_name = ggml_blocks.ggml_type_for(q)
    head = ggml_blocks.BLOCKS[type_name][1] - 16
    blocks = torch.empty((*q.shape[:-1], q.shape[-1] // 32, head + 16), dtype=torch.uint8)
    if q.scheme.bits == 4 and not q.scheme.is_binary:
        quants = q.codes()
    elif q.scheme.is_binary:
        quants = q.codes() * 2 + 7
    elif type_name == "Q4_0":
        quants = q.codes().to(torch.int16) - 2 ** (q.scheme.bits - 1) + 8
    else:
        quants = q.codes()
    blocks[..., head:] = ggml_blocks._ggml_nibbles(quants.to(torch.uint8))

    def fp16_bytes(values):
        values = values.repeat_interleave(q.scheme.group_size // 32, dim=-1)
        return values.to(torch.float16).contiguous().view(torch.uint8).reshape(*values.shape, 2)

    if type_name == "MXFP4":
        blocks[..., 0] = q.scales
    else:
        blocks[..., 0:2] = fp16_bytes(q.scales.float())
        if type_name == "Q4_1":
            blocks[..., 2:4] = fp16_bytes(-(q.zeros.float() * q.scales.float()))
    return blocks.reshape(*q.shape[:-1], -1).numpy()


@pytest.mark.parametrize(
    "scheme",
    [
        QuantScheme("mxfp4"),
        QuantScheme("int4", 32, symmetric=True),
        QuantScheme("int4", 64, symmetric=False),
        QuantScheme("int4", 128, symmetric=False),
        QuantScheme("int2", 32, symmetric=False),
        QuantScheme("binary"),
        QuantScheme("w4a8"),
    ],
)
def test_vectorised_repack_in_small_chunks_gives_the_bytes_of_the_torch_repack(scheme, monkeypatch):
    monkeypatch.setattr(ggml_blocks, "CHUNK_BYTES", 40 * 128)  # 40 rows a chunk: chunks end inside an expert
    q = scheme.quantize(_weights())
    half = replace(
        q,
        shape=(3, 48, 256),
        packed=q.packed[:, 48:],
        scales=q.scales[:, 48:],
        zeros=None if q.zeros is None else q.zeros[:, 48:],
    )
    for matrix in (q, half):
        assert np.array_equal(ggml_blocks.to_ggml(matrix).blocks, _torch_to_ggml(matrix))
        joined = b"".join(chunk.tobytes() for chunk in ggml_blocks.ggml_chunks(matrix))
        assert joined == _torch_to_ggml(matrix).tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_exports_finite_check_finds_one_bad_value_in_any_chunk(dtype, bad):
    from moecompress.export import source

    values = torch.randn(3 * (1 << 18) + 5).to(dtype)
    assert not source.holds_non_finite(values)
    for where in (0, (1 << 18) - 1, 1 << 18, values.numel() - 1):
        spoiled = values.clone()
        spoiled[where] = bad
        assert source.holds_non_finite(spoiled), where
    assert source.holds_non_finite(torch.tensor([1.0, bad], dtype=torch.float64))


def test_a_nan_in_a_dense_weight_is_refused_naming_it(native_outputs, tmp_path):
    from moecompress.export.to_bf16 import open_native

    directory = tmp_path / "spoiled"
    shutil.copytree(native_outputs[("qwen3_moe", "mxfp4")], directory)
    reader, native = open_native(directory)
    with reader:
        key = next(k for k in native.outside if reader.dtype_of(k).is_floating_point and "embed" in k)
        info, dtype = reader.tensors[key], reader.dtype_of(key)
        with open(directory / info.file, "r+b") as handle:
            handle.seek(info.offset + dtype.itemsize * 7)
            handle.write(torch.tensor([float("nan")], dtype=dtype).view(torch.uint8).numpy().tobytes())
        with pytest.raises(UserInputError, match=f"tensor '{key}' holds NaN or Inf"):
            native.outside_tensors()


@needs_converter
def test_the_converter_in_our_process_writes_the_subprocess_bytes_and_leaves_our_modules(
    native_outputs, tmp_path, monkeypatch
):
    """In-process, the converter imports its own gguf-py; afterwards ``import gguf`` is ours again and nothing of
    its modules or paths is left."""
    from moecompress.export import converter_scope, llama_cpp

    def no_subprocess(*args):
        raise AssertionError("the in-process route ran a subprocess")

    ours_gguf, path, argv = sys.modules["gguf"], list(sys.path), list(sys.argv)
    directory = native_outputs[("qwen3_moe", "mxfp4")]
    export_bf16(directory, tmp_path / "view", progress=False)
    files = {}
    for route in (True, False):
        files[route] = tmp_path / f"in_process_{route}.gguf"
        with monkeypatch.context() as patch:
            if route:
                patch.setattr(llama_cpp, "_run_subprocess", no_subprocess)
            done = run_converter(find_converter(None), tmp_path / "view", files[route], in_process=route)
        assert done["substituted"] == [] and done["hole_offsets"] == {}
    assert files[True].read_bytes() == files[False].read_bytes()
    assert sys.modules["gguf"] is ours_gguf and sys.path == path and sys.argv == argv
    assert not [name for name in sys.modules if name.split(".")[0] in ("conversion", "convert_hf_to_gguf")]
    assert converter_scope.usable()


@needs_converter
def test_the_converters_failure_in_our_process_is_one_line(tmp_path):
    from moecompress.export import converter_scope

    shutil.copytree(BUILTIN, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    assert converter_scope.usable()
    with pytest.raises(UserInputError, match=r"converter failed on .*not supported") as caught:
        run_converter(find_converter(None), tmp_path / "model", tmp_path / "out.gguf", in_process=True)
    assert "\n" not in str(caught.value)
    assert sys.modules["gguf"].__file__.startswith(str(Path(gguf.__file__).parent))


@needs_converter
def test_an_export_through_the_converters_own_process_writes_the_same_file(native_outputs, tmp_path, monkeypatch):
    """The fallback (another thread running, say): the converter in a subprocess, which notes the holes' offsets
    too."""
    from moecompress.export import converter_scope

    reader = gguf.GGUFReader

    def unread(path):
        if inspect.stack()[1].function == "_hole_offsets":
            raise AssertionError("the holes' offsets were read back from the file, not noted")
        return reader(path)

    directory = native_outputs[("qwen3_moe", "int4-asym")]
    monkeypatch.setattr(gguf, "GGUFReader", unread)
    export_gguf(directory, tmp_path / "here.gguf", progress=False)
    monkeypatch.setattr(converter_scope, "usable", lambda: False)
    export_gguf(directory, tmp_path / "apart.gguf", progress=False)
    monkeypatch.undo()
    assert (tmp_path / "here.gguf").read_bytes() == (tmp_path / "apart.gguf").read_bytes()


KEEP_OTHERS = Request(pins=parse_pins([".=keep"]))
"""The converter's own types for every tensor but our experts' blocks (the export before gguf_retype)."""

KQUANTS = {"q2_k": "Q4_0", "q3_k": "Q4_0", "q4_k": "Q5_0", "q5_k": "Q5_1", "q6_k": "Q8_0"}
"""Each k-quant's 32-weight fallback at widths not a multiple of 256."""
KQUANT_FILE_TYPES = {"q2_k": "MOSTLY_Q2_K", "q3_k": "MOSTLY_Q3_K_S", "q4_k": "MOSTLY_Q4_K_S"}
KQUANT_FILE_TYPES |= {"q5_k": "MOSTLY_Q5_K_S", "q6_k": "MOSTLY_Q6_K"}


@pytest.mark.parametrize("name", list(KQUANTS))
@pytest.mark.parametrize("cols", [512, 96])
def test_kquant_experts_become_their_own_ggml_blocks_in_small_chunks(name, cols, monkeypatch):
    monkeypatch.setattr(ggml_blocks, "CHUNK_BYTES", 5 * cols // 2)  # 5 rows a chunk: chunks end inside an expert
    q = QuantScheme(name, 256).quantize(_weights(rows=12, cols=cols))
    kind = name.upper() if cols == 512 else KQUANTS[name]
    blocks = ggml_blocks.to_ggml(q)
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    assert blocks.type_name == kind and blocks.blocks.shape == (3, 12, cols // block * block_bytes)
    assert blocks.blocks.tobytes() == b"".join(chunk.tobytes() for chunk in ggml_blocks.ggml_chunks(q))
    theirs = gguf.quants.dequantize(blocks.blocks, gguf.GGMLQuantizationType[kind])
    assert np.array_equal(theirs.astype(np.float32).view(np.uint32), q.dequantize().numpy().view(np.uint32))
    assert ggml_blocks.measure(q) == ggml_blocks.BlockError(0.0, 0.0, 0, q.numel)


@pytest.fixture(scope="module")
def kquant_outputs(tmp_path_factory):
    """The builtin model (experts [8, 512, 128] gate_up and [8, 128, 256] down) in each k-quant: gate and up take
    the fallback (width 128), down the k-quant itself (width 256)."""
    root = tmp_path_factory.mktemp("kquants")
    out = {}
    for name in KQUANTS:
        out[name] = root / name
        quantize_checkpoint(BUILTIN, out[name], QuantizeConfig(scheme=name, group_size=256), progress=False)
    return out


@needs_converter
@pytest.mark.parametrize("name", list(KQUANTS))
def test_kquant_gguf_export_writes_our_blocks_bit_for_bit(kquant_outputs, tmp_path, name):
    directory = kquant_outputs[name]
    out = tmp_path / "model.gguf"
    report = export_gguf(directory, out, progress=False)
    main, fallback = name.upper(), KQUANTS[name]
    assert report["experts"]["written_as"] == sorted({main, fallback})
    assert report["experts"]["all_exact"] and report["experts"]["file_type"] == KQUANT_FILE_TYPES[name]
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType[KQUANT_FILE_TYPES[name]]
    tensors = {t.name: t for t in reader.tensors}
    seen = set()
    with CheckpointReader(directory) as source_reader:
        source = NativeSource(source_reader, adapter_for(source_reader.config))
        for layer in source.iter_layers():
            for matrix, q in _gguf_expert_matrices(layer).items():
                gguf_name = f"blk.{layer.layer}.ffn_{matrix}_exps.weight"
                tensor = tensors[gguf_name]
                kind = main if matrix == "down" else fallback
                assert tensor.tensor_type.name == kind == report["experts"]["tensors"][gguf_name]["type"]
                got = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
                assert np.array_equal(got.reshape(q.shape).view(np.uint32), q.dequantize().numpy().view(np.uint32))
                seen.add(gguf_name)
    assert len(seen) == 3 * 4 and seen == set(report["experts"]["tensors"])


def test_a_routed_expert_scheme_with_no_ggml_form_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    from moecompress.cli.main import main
    from moecompress.quantization.schemes import register, unregister
    from moecompress.quantization.schemes.integer import INT4

    @register
    class NoGGML(INT4):
        name = "int4_no_ggml"

        def ggml_type(self, scheme, has_zeros):
            return None

    try:
        directory = tmp_path / "no-ggml"
        quantize_checkpoint(BUILTIN, directory, QuantizeConfig(scheme="int4_no_ggml"), progress=False)
        out = tmp_path / "x.gguf"
        monkeypatch.setenv(ENV_VAR, "")  # the refusal comes before the converter is looked for
        argv = ["moecompress", "export", str(directory), "--format", "gguf", "--out", str(out)]
        monkeypatch.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as stop:
            main()
    finally:
        unregister("int4_no_ggml")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "int4_no_ggml has no GGML block type" in err and "--format bf16" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-ggml"]
