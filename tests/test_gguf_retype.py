"""Every tensor in its GGML type (export/gguf_retype.py): bytes that gguf decodes to our values, pins, llama.cpp's
fallbacks and keep rules, the importance matrix, and a byte budget that is never exceeded and is spent."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from helpers import run_cli

from moecompress.errors import UserInputError
from moecompress.export import gguf_retype, gguf_types
from moecompress.export.allocation import Option, allocate, smallest
from moecompress.export.gguf_retype import TYPES_KEY, Request, Retyper, _encode
from moecompress.quantization.schemes.ggml_blocks import FORMATS

ARCH = "qwen3moe"


def write_gguf(path: Path, tensors: dict[str, np.ndarray], experts_used: int = 2, bf16: tuple[str, ...] = ()) -> None:
    writer = gguf.GGUFWriter(path, ARCH)
    writer.add_uint32(f"{ARCH}.expert_used_count", experts_used)
    writer.add_uint32(f"{ARCH}.block_count", 3)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_BF16))
    for name, array in tensors.items():
        if name in bf16:
            raw = torch.from_numpy(array).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
            writer.add_tensor(name, raw.reshape(*array.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def model_tensors(seed: int = 0, hidden: int = 256, experts: int = 3) -> dict[str, np.ndarray]:
    """A small model in llama.cpp's names: 256-wide rows (k-quants) and 96-wide rows (their fallbacks)."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    return {
        "token_embd.weight": w(32, hidden),
        "blk.0.attn_norm.weight": np.ones(hidden, np.float32),
        "blk.0.attn_q.weight": w(64, hidden),
        "blk.0.attn_k.weight": w(32, hidden),
        "blk.0.attn_output.weight": w(48, hidden),
        "blk.0.ffn_gate_inp.weight": w(experts, hidden),
        "blk.0.ffn_gate_exps.weight": w(experts, 32, hidden),
        "blk.0.ffn_down_exps.weight": w(experts, 40, 96),
        "output_norm.weight": np.ones(hidden, np.float32),
        "output.weight": w(32, hidden),
    }


def read_back(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    reader = gguf.GGUFReader(path)
    out = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        values = gguf.quants.dequantize(tensor.data, kind) if kind.name not in ("F32", "F16") else tensor.data
        out[tensor.name] = (kind.name, np.asarray(values, dtype=np.float32))
    return out


def ours(type_name: str, weight: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """Our encoder's values for ``weight``, weighted as the export weights it (importance x llama.cpp's magnitude)."""
    x = torch.from_numpy(weight)
    w = torch.ones(weight.shape[-1]) if importance is None else torch.from_numpy(importance)
    return FORMATS[type_name].decode(_encode(type_name, x, w)).reshape(weight.shape).numpy()


def test_the_encoding_weights_each_weight_as_llama_cpp_does(monkeypatch):
    """importance * sqrt(sigma2 + x^2): sigma2 the mean square over the super-block (times 2 for Q3_K..Q5_K) or
    over the row for the 32-wide types; Q6_K and Q8_0 the importance alone."""
    seen = {}
    fakes = {
        name: SimpleNamespace(block=FORMATS[name].block, encode=lambda x, w, t=name: seen.__setitem__(t, w.reshape(-1)))
        for name in ("Q2_K", "Q4_K", "Q5_0", "Q6_K")
    }
    monkeypatch.setattr(gguf_retype, "FORMATS", fakes)
    x = torch.linspace(-1, 1, 512).reshape(1, 512)
    importance = torch.rand(512) + 0.5
    for type_name in ("Q2_K", "Q4_K", "Q5_0", "Q6_K"):
        _encode(type_name, x, importance)
    first = x[0, :256]
    assert torch.allclose(seen["Q2_K"][:256], importance[:256] * torch.sqrt((first**2).mean() + first**2))
    assert torch.allclose(seen["Q4_K"][:256], importance[:256] * torch.sqrt(2 * (first**2).mean() + first**2))
    assert torch.allclose(seen["Q5_0"], importance * torch.sqrt((x[0] ** 2).mean() + x[0] ** 2))
    assert torch.equal(seen["Q6_K"], importance)


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0"])
def test_every_quantisable_tensor_in_the_type_decodes_with_gguf_to_our_values(tmp_path, type_name):
    tensors = model_tensors()
    write_gguf(tmp_path / "in.gguf", tensors, bf16=("blk.0.attn_q.weight",))
    retyper = Retyper(tmp_path / "in.gguf", Request(default_type=type_name))
    retyper.plan(progress=False)
    retyper.write(tmp_path / "out.gguf", progress=False)
    back = read_back(tmp_path / "out.gguf")
    assert list(back) == list(tensors)
    for name, array in tensors.items():
        kind, values = back[name]
        if not gguf_types.quantisable(name, array.ndim):
            assert kind == "F32" and np.array_equal(values, array), name
            continue
        expected_kind = gguf_types.stored_type(type_name, array.shape[-1])
        assert kind == expected_kind, name
        source = array
        if name == "blk.0.attn_q.weight":
            source = torch.from_numpy(array).to(torch.bfloat16).float().numpy()
        assert np.array_equal(values.reshape(array.shape), ours(kind, source)), name
    fields = gguf.GGUFReader(tmp_path / "out.gguf").fields
    types = json.loads(fields[TYPES_KEY].contents())
    assert types["blk.0.ffn_down_exps.weight"] == gguf_types.stored_type(type_name, 96)
    assert fields[f"{ARCH}.expert_used_count"].contents() == 2


def test_widths_take_llama_cpp_fallbacks_and_keep_rules():
    assert gguf_types.stored_type("Q2_K", 96) == "Q4_0"
    assert gguf_types.stored_type("Q3_K", 96) == "Q4_0"
    assert gguf_types.stored_type("Q4_K", 96) == "Q5_0"
    assert gguf_types.stored_type("Q5_K", 96) == "Q5_1"
    assert gguf_types.stored_type("Q6_K", 96) == "Q8_0"
    assert gguf_types.stored_type("Q4_K", 512) == "Q4_K"
    assert gguf_types.stored_type("Q4_K", 40) is None
    assert not gguf_types.quantisable("blk.3.ffn_gate_inp.weight", 2)
    assert not gguf_types.quantisable("blk.3.attn_q_norm.weight", 1)
    assert not gguf_types.quantisable("blk.3.ssm_conv1d.weight", 2)
    assert gguf_types.quantisable("blk.3.ffn_up_shexp.weight", 2)
    assert gguf_types.quantisable("output.weight", 2)


def test_pins_win_in_order_and_keep_leaves_the_tensor(tmp_path):
    tensors = model_tensors()
    write_gguf(tmp_path / "in.gguf", tensors)
    pins = gguf_types.parse_pins(["attn_q=Q6_K", r"attn_=Q5_K", r"output\.weight=keep"])
    retyper = Retyper(tmp_path / "in.gguf", Request(pins=pins, default_type="Q4_K"))
    retyper.plan(progress=False)
    retyper.write(tmp_path / "out.gguf", progress=False)
    back = read_back(tmp_path / "out.gguf")
    assert back["blk.0.attn_q.weight"][0] == "Q6_K"
    assert back["blk.0.attn_k.weight"][0] == "Q5_K"
    assert back["output.weight"][0] == "F32"
    assert back["token_embd.weight"][0] == "Q4_K"


@pytest.mark.parametrize(
    "value", ["attn_q", "attn_q=Q9_K", "=Q4_K", "(=Q4_K"], ids=["no type", "bad type", "no pattern", "bad regex"]
)
def test_bad_pins_are_refused(value):
    with pytest.raises(UserInputError, match="--tensor-type"):
        gguf_types.parse_pins([value])


@pytest.mark.parametrize("text,expected", [("1000", 1000), ("5.2MB", 5_200_000), ("2KiB", 2048), ("1.5GiB", 3 << 29)])
def test_sizes_parse(text, expected):
    assert gguf_types.parse_size(text) == expected


def test_a_bad_size_is_refused():
    with pytest.raises(UserInputError, match="--target-size"):
        gguf_types.parse_size("lots")


def test_allocation_is_optimal_on_a_small_problem_by_brute_force():
    rng = np.random.default_rng(3)
    options = {}
    for index in range(5):
        sizes = sorted(rng.choice(np.arange(10, 100), size=4, replace=False))
        errors = sorted(rng.uniform(0, 10, size=4), reverse=True)
        pairs = enumerate(zip(sizes, errors, strict=True))
        options[f"t{index}"] = [Option(f"T{k}", int(size), float(error)) for k, (size, error) in pairs]
    import itertools

    names = list(options)
    for budget in range(smallest(options), sum(max(o.nbytes for o in v) for v in options.values()) + 1, 17):
        chosen = allocate(options, budget)
        spent = sum(option.nbytes for option in chosen.values())
        assert spent <= budget
        best = min(
            sum(option.error for option in combo)
            for combo in itertools.product(*(options[name] for name in names))
            if sum(option.nbytes for option in combo) <= budget
        )
        found = sum(option.error for option in chosen.values())
        assert found <= best * 1.25 + 1e-9
        steps = [o.nbytes - chosen[n].nbytes for n in names for o in options[n] if o.nbytes > chosen[n].nbytes]
        assert not steps or budget - spent < max(steps)


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.7, 1.0])
def test_target_size_is_never_exceeded_and_spent_within_one_step(tmp_path, fraction):
    tensors = model_tensors(seed=1)
    write_gguf(tmp_path / "in.gguf", tensors)
    low = Retyper(tmp_path / "in.gguf", Request(default_type="Q2_K"))
    high = Retyper(tmp_path / "in.gguf", Request(default_type="Q8_0"))
    for retyper, name in ((low, "low.gguf"), (high, "high.gguf")):
        retyper.plan(progress=False)
        retyper.write(tmp_path / name, progress=False)
    smallest_file, largest_file = (tmp_path / "low.gguf").stat().st_size, (tmp_path / "high.gguf").stat().st_size
    target = int(smallest_file + fraction * (largest_file - smallest_file)) + 256
    retyper = Retyper(tmp_path / "in.gguf", Request(target_bytes=target))
    retyper.plan(progress=False)
    retyper.write(tmp_path / "out.gguf", progress=False)
    size = (tmp_path / "out.gguf").stat().st_size
    assert size <= target
    steps = [
        option.nbytes - entry.nbytes
        for entry in retyper.entries
        for option in entry.options
        if option.nbytes > entry.nbytes and entry.type_name
    ]
    if steps:
        assert target - size < max(steps) + 1024  # the header and padding reserve is under 1 KiB here
    back = read_back(tmp_path / "out.gguf")
    assert len({back[name][0] for name in back if gguf_types.quantisable(name, tensors[name].ndim)}) >= 1


def test_target_size_below_the_smallest_types_is_refused_before_writing(tmp_path):
    write_gguf(tmp_path / "in.gguf", model_tensors())
    retyper = Retyper(tmp_path / "in.gguf", Request(target_bytes=8_000))
    with pytest.raises(UserInputError, match="too small"):
        retyper.plan(progress=False)


def test_target_bpw_budget_counts_every_tensor(tmp_path):
    tensors = model_tensors()
    write_gguf(tmp_path / "in.gguf", tensors)
    retyper = Retyper(tmp_path / "in.gguf", Request(target_bpw=5.0))
    retyper.plan(progress=False)
    retyper.write(tmp_path / "out.gguf", progress=False)
    data = sum(t.n_bytes for t in gguf.GGUFReader(tmp_path / "out.gguf").tensors)
    weights = sum(a.size for a in tensors.values())
    assert data * 8 / weights <= 5.0


def write_imatrix(path: Path, entries: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    writer = gguf.GGUFWriter(path, arch="imatrix")
    writer.add_type("imatrix")
    for name, (sums, counts) in entries.items():
        writer.add_tensor(f"{name}.in_sum2", sums.astype(np.float32))
        writer.add_tensor(f"{name}.counts", counts.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_imatrix_weights_the_encoding_per_expert(tmp_path):
    tensors = model_tensors()
    write_gguf(tmp_path / "in.gguf", tensors)
    rng = np.random.default_rng(5)
    sums = rng.uniform(0.01, 4.0, size=(3, 256)) * 100
    counts = np.array([[100.0], [0.0], [20.0]])
    q_sums = rng.uniform(0.01, 4.0, size=256) * 1000
    write_imatrix(
        tmp_path / "im.gguf",
        {
            "blk.0.ffn_gate_exps.weight": (sums, counts),
            "blk.0.attn_q.weight": (q_sums, np.array([1000.0])),
        },
    )
    request = Request(default_type="Q3_K", imatrix=tmp_path / "im.gguf")
    retyper = Retyper(tmp_path / "in.gguf", request)
    retyper.plan(progress=False)
    retyper.write(tmp_path / "out.gguf", progress=False)
    back = read_back(tmp_path / "out.gguf")
    gate = tensors["blk.0.ffn_gate_exps.weight"]
    for expert in range(3):
        importance = (sums[expert] / counts[expert]).astype(np.float32) if counts[expert, 0] else np.ones(256)
        mean = importance.mean()
        importance = np.maximum(importance, 1e-6 * mean).astype(np.float32)
        expected = ours("Q3_K", gate[expert], importance)
        assert np.array_equal(back["blk.0.ffn_gate_exps.weight"][1].reshape(gate.shape)[expert], expected)
    plain = ours("Q3_K", gate[0])
    assert not np.array_equal(plain, back["blk.0.ffn_gate_exps.weight"][1].reshape(gate.shape)[0])
    report = retyper.report()["tensors"]
    assert report["blk.0.attn_q.weight"]["importance"] == "imatrix"
    assert report["blk.0.attn_k.weight"]["importance"].startswith("uniform")


def test_a_file_that_is_not_an_imatrix_is_refused(tmp_path):
    write_gguf(tmp_path / "in.gguf", model_tensors())
    with pytest.raises(UserInputError, match="--imatrix"):
        Retyper(tmp_path / "in.gguf", Request(imatrix=tmp_path / "in.gguf"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--target-size", "lots"], "--target-size lots"),
        (["--target-size", "5MB", "--target-bpw", "4"], "give one budget"),
        (["--tensor-type", "attn=Q9"], "--tensor-type attn=Q9"),
        (["--imatrix", "IMATRIX"], "a plain checkpoint keeps the converter's types"),
        (["--imatrix", "MISSING", "--target-size", "5MB"], "no such file"),
    ],
    ids=["size", "two budgets", "pin", "imatrix alone", "missing imatrix"],
)
def test_bad_type_options_are_one_line_before_any_work(tmp_path, extra, message):
    write_imatrix(tmp_path / "im.gguf", {"blk.0.attn_q.weight": (np.ones(256), np.array([1.0]))})
    extra = [{"IMATRIX": str(tmp_path / "im.gguf"), "MISSING": str(tmp_path / "no.gguf")}.get(e, e) for e in extra]
    out = tmp_path / "x.gguf"
    done = run_cli("export", "builtin:tiny-moe", "--format", "gguf", "--out", str(out), *extra)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert not out.exists() and not any(p.name.startswith(".x.gguf") for p in tmp_path.iterdir())


def test_gguf_options_are_refused_for_bf16(tmp_path):
    out = str(tmp_path / "d")
    done = run_cli("export", "builtin:tiny-moe", "--format", "bf16", "--out", out, "--base-type", "Q4_K")
    assert done.returncode == 2 and "apply to --format gguf only" in done.stderr


def test_a_layers_tensor_counts_as_one_of_the_residual_streams_2L_contributions(tmp_path):
    """A decoder layer's tensor perturbs one of 2 x block_count additions to the residual stream; the embedding and
    the head the whole stream: their relative errors weigh 2 x block_count times as much."""
    tensors = model_tensors()
    write_gguf(tmp_path / "in.gguf", tensors)
    retyper = Retyper(tmp_path / "in.gguf", Request(target_bytes=10**9))
    retyper.plan(progress=False)
    entries = {entry.name: entry for entry in retyper.entries}
    for name in ("blk.0.attn_q.weight", "output.weight"):
        entry = entries[name]
        tensor = retyper.reader.tensors[entry.index]
        measured = gguf_retype.measure(tensor, entry.shape, [o.type_name for o in entry.options], entry.importance)
        share = 1 / 6 if name.startswith("blk.") else 1.0
        for option in entry.options:
            assert option.error == pytest.approx(share * measured[option.type_name])
