"""Bad input is refused with one line and exit code 2, nothing is written, and reruns are byte-identical."""

import json
import shutil

from helpers import run_cli, tree_hashes
from safetensors.torch import load_file, save_file


def _refused(result, fragment, out=None):
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    if out is not None:
        assert not out.exists() and not any(out.parent.glob(f".{out.name}*")), "nothing may be written"


def _quick_prune(model, out, *options):
    """``moecompress prune`` with a small calibration set and no evaluation; ``options`` override or add."""
    defaults = {"--calib-tokens": "256", "--seq-len": "64"}
    given = dict(zip(options[::2], options[1::2], strict=True))
    args = [arg for key, value in {**defaults, **given}.items() for arg in (key, value)]
    return run_cli("prune", str(model), "--out", str(out), *args, "--no-eval")


def _copy_with(tmp_path, source, name, edit):
    target = tmp_path / name
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_nan_weights_are_named(tiny_with_tokenizer, tmp_path):
    def poison(tensors):
        tensors["model.layers.1.mlp.experts.3.up_proj.weight"][0, 0] = float("nan")

    broken = _copy_with(tmp_path, tiny_with_tokenizer["qwen3_moe"], "nan", poison)
    out = tmp_path / "out"
    result = _quick_prune(broken, out)
    _refused(result, "'model.layers.1.mlp.experts.3.up_proj.weight' holds NaN or Inf", out)


def test_config_and_weights_that_disagree(tiny_with_tokenizer, tmp_path):
    broken = tmp_path / "shapes"
    shutil.copytree(tiny_with_tokenizer["qwen3_moe"], broken)
    config = json.loads((broken / "config.json").read_text())
    key = "num_local_experts" if "num_local_experts" in config else "num_experts"
    config[key] = 6
    (broken / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    result = _quick_prune(broken, out)
    _refused(result, "config.json says 6 experts, weights hold 8", out)


def test_too_little_calibration_data(tiny_with_tokenizer, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("only a few words of calibration text")
    out = tmp_path / "out"
    result = _quick_prune(
        tiny_with_tokenizer["qwen3_moe"], out, "--calib", str(text), "--calib-tokens", "4096", "--seq-len", "8"
    )
    _refused(result, "fewer than the 4096 asked for", out)


def test_ratio_leaving_fewer_than_top_k(tiny_with_tokenizer, tmp_path):
    out = tmp_path / "out"
    result = _quick_prune(tiny_with_tokenizer["qwen3_moe"], out, "--keep", "1")
    _refused(result, "fewer than the minimum 2", out)


def test_existing_output_needs_overwrite(tiny_with_tokenizer, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = _quick_prune(tiny_with_tokenizer["qwen3_moe"], out)
    assert result.returncode == 2 and "output directory exists" in result.stderr
    assert (out / "keep.txt").read_text() == "mine"


def test_rerun_is_byte_identical(tmp_path):
    outputs = []
    for name in ("first", "second"):
        out = tmp_path / name
        result = _quick_prune(
            "builtin:tiny-moe",
            out,
            "--ratio",
            "0.25",
            "--scope",
            "global",
            "--calib-tokens",
            "2048",
            "--seq-len",
            "256",
        )
        assert result.returncode == 0, result.stderr
        outputs.append(out)
    first, second = (tree_hashes(out) for out in outputs)
    report_a, report_b = (json.loads((out / "moecompress_report.json").read_text()) for out in outputs)
    assert report_a == report_b
    first.pop("moecompress_report.json")
    second.pop("moecompress_report.json")
    assert first == second, "weights, config and tokenizer files must be byte-identical"
