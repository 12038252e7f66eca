"""Wall and CPU time of short tiny-moe commands with 1 thread, 2 threads under libgomp's default wait policy, and 2
threads with ``OMP_WAIT_POLICY=PASSIVE``, optionally beside two extra busy loops (BENCHMARKS.md, "Threads").

The configurations of one command run back to back, so that a shared machine's load changes as little as possible
between them. Each run sets ``OMP_WAIT_POLICY`` itself: ``default`` removes the value the CLI package sets on import
(before torch loads), so that libgomp runs with its own default (spinning a while before sleeping).

    python scripts/bench_threads.py --commands gptq,recipe --loads none,busy
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPE = """model: builtin:tiny-moe
calibration: {source: builtin:prose, tokens: 1024, seq_len: 256, seed: 0}
passes:
  - prune_experts: {method: maep, ratio: 0.25, scope: layer}
  - quantize: {scheme: mxfp4}
  - lowrank: {lowrank_budget: 0.375}
  - eval: {data: builtin:prose, tokens: 512}
"""
LAUNCH = """import os, sys
import moecompress.cli
if os.environ["OMP_WAIT_POLICY"] == "default":
    del os.environ["OMP_WAIT_POLICY"]
from moecompress.cli.main import main
sys.argv[0] = "moecompress"
main()
"""
CONFIGS = {
    "1": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "default"},
    "2": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "default"},
    "2-passive": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
}


def commands(recipe: Path) -> dict[str, list[str]]:
    return {
        "gptq": [
            "quantize",
            "builtin:tiny-moe",
            "--scheme",
            "int4",
            "--method",
            "gptq",
            "--calib-tokens",
            "512",
            "--no-eval",
        ],
        "recipe": ["run", str(recipe)],
    }


def timed(command: list[str], settings: dict[str, str], out: Path) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system, all threads) of one run."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, **settings}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    subprocess.run(
        [sys.executable, "-c", LAUNCH, *command, "--out", str(out), "--quiet"],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commands", default="gptq,recipe", help="comma-separated: gptq, recipe")
    parser.add_argument("--loads", default="none,busy", help="comma-separated: none, busy (two busy loops)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        recipe = Path(scratch) / "recipe.yaml"
        recipe.write_text(RECIPE)
        print("command\tload\tthreads\twall s\tCPU s\tload average")
        for name in args.commands.split(","):
            for load in args.loads.split(","):
                loops = 2 if load == "busy" else 0
                busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(loops)]
                try:
                    for config, settings in CONFIGS.items():
                        average = os.getloadavg()[0]
                        wall, cpu = timed(commands(recipe)[name], settings, Path(scratch) / "out")
                        print(f"{name}\t{load}\t{config}\t{wall:.1f}\t{cpu:.1f}\t{average:.1f}", flush=True)
                finally:
                    for process in busy:
                        process.kill()
                        process.wait()


if __name__ == "__main__":
    main()
