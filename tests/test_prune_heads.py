"""Attention-head pruning: gated and sliced models agree, outputs load where they should, the objective hits
its target, bad input is refused."""

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import run_cli, tree_hashes
from synthetic import save_tiny_model, tiny_tokenizer

from moecompress.calibration.batches import consecutive_windows, tokenize_documents
from moecompress.calibration.sources import load_documents
from moecompress.heads import GateMasks, HeadGates, HeadLayout
from moecompress.heads.train import GateSchedule, train_gates
from moecompress.loading import load_adapter, load_model, load_tokenizer
from moecompress.passes.prune_heads import build_pruned_model, head_layouts

HEAD_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
FAST = ["--steps", "4", "--distill-steps", "2", "--calib-tokens", "256", "--seq-len", "32", "--batch-size", "4"]
EVAL = ["--eval-tokens", "256"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    tokenizer = tiny_tokenizer()
    out = {}
    for family in HEAD_FAMILIES:
        path = save_tiny_model(family, root / family)
        tokenizer.save_pretrained(path)
        out[family] = path
    return out


def _keep_all_but(layouts, removed):
    return [[u for u in range(layout.units) if u != removed[i]] for i, layout in enumerate(layouts)]


@pytest.mark.parametrize(
    "family,unit", [(f, "kv-group") for f in HEAD_FAMILIES] + [("qwen3_moe", "query-head"), ("mixtral", "query-head")]
)
def test_gates_closed_on_units_give_the_sliced_models_logits(family, unit, checkpoints):
    adapter = load_adapter(checkpoints[family])
    model = load_model(checkpoints[family], adapter)
    layouts = head_layouts(adapter, unit)
    if unit == "kv-group":
        removed = [i % layout.units for i, layout in enumerate(layouts)]
        keep = _keep_all_but(layouts, removed)
    else:  # one query head from every KV group
        keep = [
            [u for u in range(layout.units) if u % layout.group_size != i % layout.group_size]
            for i, layout in enumerate(layouts)
        ]
    kept = {i: layout.kept_heads(keep[i]) for i, layout in enumerate(layouts)}
    new_config = adapter.with_head_counts(
        {i: (len(q), len(kv)) for i, (q, kv) in kept.items()}, {i: q for i, (q, _) in kept.items()}
    )
    student, _ = build_pruned_model(model, adapter, new_config, keep, layouts)
    gates = [
        torch.tensor([1.0 if u in keep[i] else 0.0 for u in range(layout.units)]) for i, layout in enumerate(layouts)
    ]
    ids = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        with GateMasks(model, adapter, layouts) as masks:
            masks.set(gates)
            gated = model(input_ids=ids).logits
        sliced = student(input_ids=ids).logits
    torch.testing.assert_close(sliced, gated, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(full, gated, atol=1e-3), "closing heads must change the output"
    assert sum(p.numel() for p in student.parameters()) < sum(p.numel() for p in model.parameters())


def _heldout_ids(model_dir, seq_len=32, tokens=256):
    stream = tokenize_documents(load_documents("builtin:prose", default_part="heldout"), load_tokenizer(model_dir))
    return consecutive_windows(stream, seq_len, tokens).input_ids


_STOCK_PPL = """
import json, math, sys, torch, torch.nn.functional as F, transformers
ids = torch.tensor(json.load(open(sys.argv[2])))
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
with torch.no_grad():
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
assert "moecompress" not in sys.modules
print(math.exp(float(nll)))
"""


def _stock(*args):
    return subprocess.run(
        [sys.executable, "-c", _STOCK_PPL, *map(str, args)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_uniform_output_loads_in_stock_transformers_and_reproduces_the_perplexity(family, checkpoints, tmp_path):
    source = checkpoints[family]
    before = tree_hashes(source)
    out = tmp_path / "out"
    result = run_cli("prune-heads", str(source), "--out", str(out), "--ratio", "0.5", *FAST, *EVAL)
    assert result.returncode == 0, result.stderr
    assert tree_hashes(source) == before, "input directory changed"
    config = json.loads((out / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    original = json.loads((source / "config.json").read_text())
    assert (heads, kv_heads) == (original["num_attention_heads"] // 2, original["num_key_value_heads"] // 2)
    assert config["head_dim"] == (
        original.get("head_dim") or original["hidden_size"] // original["num_attention_heads"]
    )
    report = json.loads((out / "moecompress_report.json").read_text())
    assert report["stock_loadable"] and report["uniform"]
    assert report["kv_cache_bytes_per_token"]["after"] * 2 == report["kv_cache_bytes_per_token"]["before"]
    assert len(report["gates"]["open_probability"][-1]) == original["num_hidden_layers"]
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(_heldout_ids(source).tolist()))
    stock = _stock(out, ids)
    assert stock.returncode == 0, stock.stderr
    assert float(stock.stdout) == pytest.approx(report["eval"]["perplexity"], rel=1e-4)


@pytest.mark.parametrize("family,scope", [("olmoe", "layer"), ("qwen3_moe", "global")])
def test_plugin_only_outputs_load_after_import_and_are_refused_without(family, scope, checkpoints, tmp_path):
    out = tmp_path / "out"
    args = ["--ratio", "0.25", "--scope", scope] if scope == "global" else ["--ratio", "0.5"]
    result = run_cli("prune-heads", str(checkpoints[family]), "--out", str(out), *args, *FAST, "--no-eval")
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "moecompress_report.json").read_text())
    assert not report["stock_loadable"]
    section = json.loads((out / "config.json").read_text())["moecompress"]
    assert set(section["attention_heads_per_layer"]) == set(report["layers"])
    if scope == "global":
        assert not report["uniform"] and report["units_after"] == report["units_before"] - 1
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(_heldout_ids(checkpoints[family]).tolist()))
    refused = _stock(out, ids)
    assert refused.returncode != 0 and "mismatch" in refused.stderr

    import transformers

    import moecompress  # noqa: F401  (the plugin)

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    for layer, info in report["layers"].items():
        attention = model.model.layers[int(layer)].self_attn
        assert attention.q_proj.out_features == info["heads_after"][0] * attention.head_dim
        assert attention.k_proj.out_features == info["heads_after"][1] * attention.head_dim
    windows = torch.tensor(json.loads(ids.read_text()))
    with torch.no_grad():
        logits = model(input_ids=windows).logits[:, :-1]
    assert math.isfinite(float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))))


class _ConstantModel(torch.nn.Module):
    """Logits that ignore the gates: only the sparsity objective moves them."""

    def forward(self, input_ids, use_cache=False):
        return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 8)})()


class _NoMasks:
    def set(self, gates):
        pass


def test_sparsity_objective_drives_the_expected_open_count_to_the_target():
    layouts = [HeadLayout(8, 4, 16, "kv-group"), HeadLayout(8, 4, 16, "kv-group"), HeadLayout(8, 8, 16, "kv-group")]
    gates = HeadGates([layout.units for layout in layouts], init_log_alpha=2.0)
    constraint = torch.tensor([0] * 4 + [1] * 4 + [2] * 8)
    targets = torch.tensor([3.0, 2.0, 4.0])
    schedule = GateSchedule(steps=200, lr=10.0, lambda_lr=2.0, noise_bias=2.0, warmup_fraction=0.5)
    batches = [torch.zeros(2, 4, dtype=torch.long)]
    run = train_gates(
        _ConstantModel(), _NoMasks(), gates, constraint, targets, batches, None, schedule, seed=0, progress=False
    )
    expected = [float(p.detach().sum()) for p in gates.open_probability()]
    assert expected == pytest.approx(targets.tolist(), abs=0.1)
    assert run.curve[-1]["expected_open"] == pytest.approx(9.0, abs=0.5)
    assert run.trajectory[0][0] != run.trajectory[-1][0]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--ratio", "1.5"], "between 0 and 1"),
        (["--ratio", "0.9"], "removes every one"),
        (["--ratio", "0.25", "--unit", "query-head"], "split evenly"),
    ],
)
def test_bad_ratios_are_one_line_errors(args, message, checkpoints, tmp_path):
    result = run_cli("prune-heads", str(checkpoints["qwen3_moe"]), "--out", str(tmp_path / "o"), *args)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_unprunable_model_and_existing_output_are_refused(checkpoints, tiny_checkpoints, tmp_path):
    result = run_cli(
        "prune-heads", str(tiny_checkpoints["deepseek_v3"]), "--out", str(tmp_path / "o"), "--ratio", "0.5"
    )
    assert result.returncode == 2 and "no prunable" in result.stderr
    (tmp_path / "exists").mkdir()
    result = run_cli("prune-heads", str(checkpoints["mixtral"]), "--out", str(tmp_path / "exists"), "--ratio", "0.5")
    assert result.returncode == 2 and "--overwrite" in result.stderr
