"""scripts/gpu_check.sh --dry-run: every step of the accelerator check at tiny sizes on the CPU, one JSON object with
the keys the GPU mode prints (docs/device.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--work-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    summary = json.loads(done.stdout)
    assert summary["mode"] == "dry-run" and summary["device"] == "cpu" and summary["ok"] is True
    steps = summary["steps"]
    assert set(steps) == {"gpu_tests", "default_recipe", "large_layers", "kernels"}
    assert steps["gpu_tests"]["failed"] == 0 and steps["gpu_tests"]["skipped"] + steps["gpu_tests"]["passed"] > 0
    recipe = steps["default_recipe"]
    assert recipe["bytes_identical_to_cpu"] is True and recipe["perplexity_relative_difference"] == 0.0
    for name in ("prune_maep", "gptq_int4", "gptq_int4_lowrank"):
        assert steps["large_layers"][name]["seconds_per_layer"] > 0, name
    assert steps["kernels"]["returncode"] == 0 and steps["kernels"]["results"]
    assert not list(tmp_path.iterdir())
