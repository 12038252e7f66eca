"""The command line: inspect on every family, one-line errors with exit code 2, hub ids through the cache."""

import json
import shutil
import subprocess
import sys

import pytest
from helpers import rewrite_checkpoint, run_cli
from synthetic import FAMILIES, TINY_CONFIGS


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_every_family(family, tiny_checkpoints):
    from click.testing import CliRunner

    from moecompress.cli.main import app

    result = CliRunner().invoke(app, ["inspect", str(tiny_checkpoints[family]), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    config = TINY_CONFIGS[family]
    text_config = config.get("text_config") or config.get("thinker_config", {}).get("text_config") or config
    assert summary["family"] == family
    layers = text_config.get("num_hidden_layers", text_config.get("num_layers", text_config.get("n_layers")))
    layers = (layers or 0) + text_config.get("num_decoder_layers", 0)  # an encoder-decoder's stacks count alike
    assert summary["num_layers"] == (layers or len(text_config["layers_block_type"]))
    top_k = text_config.get("moe_topk", text_config.get("ffn_config", {}).get("moe_top_k"))  # Aria's, DBRX's
    top_k = 1 if config["model_type"] == "switch_transformers" else top_k  # top-1 by design, no config key
    assert summary["top_k"] == text_config.get("num_experts_per_tok", top_k)
    heads = text_config.get("num_attention_heads", text_config.get("n_heads", text_config.get("num_heads")))
    assert summary["attention_heads"] == heads
    assert summary["parameters"]["experts"] > 0 and summary["parameters"]["router"] > 0
    assert summary["parameters_total"] == sum(summary["parameters"].values())
    tables = {kind: count for kind, count in summary["dtypes"].items() if kind.startswith("I")}  # token-id tables
    assert summary["dtypes"] == {"F32": summary["parameters_total"] - sum(tables.values()), **tables}
    assert summary["bytes_on_disk"] > 4 * summary["parameters_total"]
    human = CliRunner().invoke(app, ["inspect", str(tiny_checkpoints[family])])
    assert human.exit_code == 0 and family in human.output


def test_inspect_builtin_tiny_moe():
    result = run_cli("inspect", "builtin:tiny-moe", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["family"] == "qwen3_moe"
    assert summary["num_layers"] >= 4 and set(summary["experts_per_layer"].values()) == {8}
    assert summary["top_k"] == 2 and summary["attention_heads"] == 8 and summary["kv_heads"] == 4


def _one_line_error(result, fragment):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert fragment in lines[0], lines[0]


def test_errors_are_one_line_with_exit_code_2(tiny_checkpoints, tmp_path):
    _one_line_error(run_cli("inspect", str(tmp_path / "missing")), "no such model directory")

    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    shutil.copy(tiny_checkpoints["qwen3_moe"] / "model.safetensors", dense)
    _one_line_error(run_cli("inspect", str(dense)), "has no MoE layers")

    unsupported = tmp_path / "unsupported"
    shutil.copytree(dense, unsupported)
    (unsupported / "config.json").write_text(json.dumps({"model_type": "made_up_moe", "num_experts": 16}))
    result = run_cli("eval", str(unsupported))
    _one_line_error(result, "unsupported MoE family 'made_up_moe'")
    assert "qwen3_moe" in result.stderr

    sharded = tmp_path / "sharded"
    rewrite_checkpoint(tiny_checkpoints["mixtral"], sharded, max_shard_bytes=20_000)
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    _one_line_error(run_cli("inspect", str(sharded)), shards[1].name)

    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_checkpoints["olmoe"], truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    _one_line_error(run_cli("inspect", str(truncated)), "truncated")

    debug = run_cli("--debug", "inspect", str(tmp_path / "missing"))
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_usage_errors_exit_2():
    result = run_cli("eval", "builtin:tiny-moe", "--seq-len", "1")
    assert result.returncode == 2


def test_hub_id_resolves_through_the_cache(tiny_checkpoints, tmp_path):
    """An org/name id goes through huggingface_hub's snapshot_download; offline, a warm cache serves it."""
    cache = tmp_path / "hub"
    repo = cache / "models--tiny-org--tiny-olmoe"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(tiny_checkpoints["olmoe"], snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    result = run_cli("inspect", "tiny-org/tiny-olmoe", "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["family"] == "olmoe"
    _one_line_error(run_cli("inspect", "tiny-org/not-cached", env=env), "not in the Hugging Face cache")


def test_repository_root_puts_no_package_but_moecompress_on_sys_path():
    """`python -m` from the root puts the root on sys.path; a root `kernels/` shadowed the PyPI `kernels` that
    transformers imports, and `import transformers` failed."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    importable = sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file() or p.suffix == ".py")
    assert importable == ["moecompress"]
    result = subprocess.run(
        [sys.executable, "-c", "import transformers.modeling_utils, moecompress.kernels.mxfp4, moecompress.cli.main"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
