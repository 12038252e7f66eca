"""Peak memory of `moecompress prune` against the size of one layer and of the whole checkpoint.

Synthesises a Qwen3-MoE checkpoint several layers deep (random bf16 weights, written layer by layer so this
script itself never holds the model), then runs `moecompress prune --no-eval` in a child process and reads the
child's peak RSS from the operating system. A second child that only imports moecompress, loads the tokenizer
and reads the config gives the fixed cost to subtract. Prints one JSON object.

Run: python scripts/bench_prune_memory.py [--layers 12] [--hidden 512] [--experts 32] [--intermediate 512]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from moecompress.checkpoint import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synthetic import write_synthetic_qwen3_moe

BASELINE = """
import sys
import moecompress
from moecompress.loading import load_adapter, load_tokenizer
from moecompress.calibration.batches import sampled_windows, tokenize_documents
from moecompress.calibration.sources import load_documents
from pathlib import Path
path = Path(sys.argv[1])
load_adapter(path)
tokenizer = load_tokenizer(path)
sampled_windows(tokenize_documents(load_documents("builtin:prose"), tokenizer), 256, int(sys.argv[2]), 0)
import transformers, tqdm
"""


def run_measured(command: list[str]) -> tuple[int, float]:
    """Run ``command`` and return its peak RSS in bytes (ru_maxrss of the waited child) and wall seconds."""
    start = time.time()
    pid = os.fork()
    if pid == 0:
        os.execvp(command[0], command)
    _, status, usage = os.wait4(pid, 0)
    seconds = time.time() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command[:6])} exited with {os.waitstatus_to_exitcode(status)}")
    return usage.ru_maxrss * 1024, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--calib-tokens", type=int, default=4096)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "synthetic"
        shapes = write_synthetic_qwen3_moe(
            source, args.layers, args.hidden, args.experts, args.intermediate, resolve_model("builtin:tiny-moe")
        )
        checkpoint_bytes = sum(p.stat().st_size for p in source.glob("*.safetensors"))
        baseline_rss, _ = run_measured([sys.executable, "-c", BASELINE, str(source), str(args.calib_tokens)])
        prune_rss, seconds = run_measured(
            [
                sys.executable,
                "-m",
                "moecompress.cli.main",
                "prune",
                str(source),
                "--out",
                str(Path(tmp) / "out"),
                "--ratio",
                "0.25",
                "--calib-tokens",
                str(args.calib_tokens),
                "--no-eval",
            ]
        )
        out_bytes = sum(p.stat().st_size for p in (Path(tmp) / "out").glob("*.safetensors"))
    layer_bytes = shapes["layer_bytes"]
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                "layers": args.layers,
                "layer_bytes_bf16": layer_bytes,
                "checkpoint_bytes": checkpoint_bytes,
                "pruned_bytes": out_bytes,
                "baseline_rss_bytes": baseline_rss,
                "prune_peak_rss_bytes": prune_rss,
                "prune_rss_above_baseline_bytes": prune_rss - baseline_rss,
                "above_baseline_in_layers": round((prune_rss - baseline_rss) / layer_bytes, 2),
                "checkpoint_in_layers": round(checkpoint_bytes / layer_bytes, 2),
                "prune_seconds": round(seconds, 1),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
