"""CPU seconds per phase of the default recipe on a small checkpoint, for two versions of the code side by side.

Builds (once, in ``--dir``) a random bf16 checkpoint of 3 layers, hidden 1024, 64 experts of intermediate 512, top-8
(0.6 GB), then for each ``--code`` directory in turn (a checkout or worktree of moecompress; each run in its own
child process, alternating, ``--repeats`` times) runs recipes/default.yaml of that checkout without its evaluation
and with ``--calib-tokens`` tokens, on one torch thread. Per run it prints one JSON line: wall seconds, the process's
CPU seconds in all and per progress phase (sensitivity forward and backward, measuring, rewriting), the bytes it
wrote besides the output (``wchar`` less the output: resume state, spills, journal) and a digest of the output's
shards, which must agree between the versions.

CPU seconds rather than wall time: on a machine shared with other jobs they move less with the load. With ``--cold``
the checkpoint's pages are dropped from the page cache before each run (``POSIX_FADV_DONTNEED``), so that every run
reads it from the disk (or what caches the disk below this system) and its wall time shows the waits on reads.

Run: python scripts/bench_pipeline_phases.py --code /path/to/old --code /path/to/new [--repeats 2] [--dir DIR] [--cold]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from page_cache import drop_from_page_cache

CHILD = r"""
import hashlib, json, shutil, sys, time
from pathlib import Path
code, checkpoint, out, tokens = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, code)
sys.path.insert(0, str(Path(code, "tests")))
import torch, yaml
torch.set_num_threads(1)
import moecompress
assert moecompress.__file__.startswith(code), moecompress.__file__
from moecompress.checkpoint import resolve_model
from synthetic import write_synthetic_qwen3_moe
if not (checkpoint / "config.json").exists():
    write_synthetic_qwen3_moe(checkpoint, 3, 1024, 64, 512, resolve_model("builtin:tiny-moe"), heads=8, kv_heads=2,
                              head_dim=128, top_k=8, vocab_size=2048)
document = yaml.safe_load(Path(code, "recipes", "default.yaml").read_text())
document["calibration"]["tokens"] = tokens
document["passes"] = [step for step in document["passes"] if "eval" not in step]
recipe = out.parent / (out.name + ".yaml")
recipe.write_text(yaml.safe_dump(document))
import moecompress.progress as progress
phases, unwrapped = {}, progress.bar
def bar(items, desc="", **kwargs):
    start = time.process_time()
    yield from unwrapped(items, desc=desc, **kwargs)
    phases[desc] = phases.get(desc, 0.0) + time.process_time() - start
import moecompress.sweep.mtp, moecompress.passes.prune_experts, moecompress.passes.quantize, moecompress.runner.pipeline
import moecompress.quantization.sensitivity, moecompress.runner.recipes, moecompress.sweep.engine
for module in list(sys.modules.values()):
    if getattr(module, "__name__", "").startswith("moecompress") and getattr(module, "progress_bar", None) is unwrapped:
        module.progress_bar = bar
from moecompress.runner.recipes import load_recipe, run_recipe
def written():
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["wchar"])
shutil.rmtree(out, ignore_errors=True)
before, wall, cpu = written(), time.perf_counter(), time.process_time()
run_recipe(load_recipe(recipe), checkpoint, out, progress=False)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
shards = sorted(out.glob("*.safetensors"))
output = sum(path.stat().st_size for path in shards)
print(json.dumps({
    "code": code, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
    "phases_cpu_s": {name: round(seconds, 1) for name, seconds in phases.items()},
    "written_besides_output": written() - before - output, "output_bytes": output,
    "digest": hashlib.sha256(b"".join(path.read_bytes() for path in shards)).hexdigest()[:16],
}), flush=True)
shutil.rmtree(out)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", action="append", required=True, type=Path, help="A moecompress checkout (twice).")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--calib-tokens", type=int, default=2048)
    parser.add_argument("--dir", type=Path, default=None, help="Where to write (default: the temporary directory).")
    parser.add_argument("--cold", action="store_true", help="Drop the checkpoint from the page cache before each run.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_phases_") as tmp:
        root = Path(tmp)
        for _ in range(args.repeats):
            for index, code in enumerate(args.code):
                command = [sys.executable, "-c", CHILD, str(code.resolve()), str(root / "checkpoint")]
                command += [str(root / f"out-{index}"), str(args.calib_tokens)]
                if args.cold:
                    drop_from_page_cache(root / "checkpoint")
                subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()
