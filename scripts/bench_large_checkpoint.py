"""A checkpoint larger than memory: wall time and peak RSS of calibrated expert pruning and MXFP4 RTN quantisation,
against the time to copy the same shard files, all measured in one run.

Synthesises a random bf16 checkpoint with Qwen3-30B-A3B's decoder layer shapes (hidden 2048, 128 experts of
intermediate 768, top-8, 32 query heads of 128 / 4 KV groups) and as many layers as reach ``--min-gib``, in
``--shard-gib`` shards as on the hub; the tokenizer is tiny-moe's 2,048 tokens (so the built-in calibration text
tokenises), and so is the vocabulary unless ``--real-vocab`` gives the embedding and an untied output projection
Qwen3-30B-A3B's 151,936 rows (1.25 GB of bf16; the rows past 2,048 are never looked up but every logit is
computed). Then, each in a child process and in this order: copy the shard files (with
fsync), ``moecompress quantize --scheme mxfp4 --method rtn``, copy again, ``moecompress prune --ratio 0.25``
(MAEP on ``--calib-tokens`` tokens), and with ``--lowrank`` MXFP4 RTN with a 0.25-bit low-rank budget. Each
command's output is fsynced inside its wall time and deleted after it. Peak RSS is the largest sum of RSS over
the child's process tree, sampled every 20 ms, and the kernel's ``ru_maxrss`` of the child. Prints one JSON
object; everything is written under ``--dir`` and removed at the end.

With ``--recipe RECIPE`` it runs ``moecompress run RECIPE --model CHECKPOINT`` instead of the quantise and prune
steps (``--layers N`` sets the layer count directly, for a small first figure) and reports, besides wall time and
peak RSS, the bytes the run read and wrote (``rchar``/``wchar`` of the process: every read and write call,
evaluation and journal included), of those the bytes of its ``--resume`` state and of the Fisher sweep's spilled
layer inputs, the output's size and the checkpoint's. ``--chained`` runs the same recipe's passes chained through
whole intermediate checkpoints, as recipes ran before the layer pipeline; ``--compare-chained`` runs both, the
pipeline first, between the same two copies. Both run with the CLI's process settings, and each starts with the
checkpoint dropped from the page cache.

``--with-eval`` runs the quantise step with its default evaluation (streamed, the output against the input).

Run: python scripts/bench_large_checkpoint.py [--min-gib 12] [--dir /tmp] [--skip-prune] [--lowrank] [--with-eval]
     python scripts/bench_large_checkpoint.py --recipe recipes/default.yaml [--layers 3] [--calib-tokens N]
         [--chained | --compare-chained] [--real-vocab]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from page_cache import drop_from_page_cache

from moecompress.checkpoint import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synthetic import write_synthetic_qwen3_moe

SHAPES = dict(hidden=2048, experts=128, inter=768, heads=32, kv_heads=4, head_dim=128, top_k=8)
REAL_VOCAB = 151936

COPY = """
import os, shutil, sys
from pathlib import Path
source, target = Path(sys.argv[1]), Path(sys.argv[2])
target.mkdir()
for path in sorted(source.iterdir()):
    shutil.copyfile(path, target / path.name)
    with open(target / path.name, "rb") as handle:
        os.fsync(handle.fileno())
"""


def layer_bytes(hidden: int, experts: int, inter: int, heads: int, kv_heads: int, head_dim: int, **_: int) -> int:
    attention = 2 * heads * head_dim * hidden + 2 * kv_heads * head_dim * hidden + 2 * head_dim
    return 2 * (3 * experts * inter * hidden + experts * hidden + attention + 2 * hidden)


def fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def tree_rss(process: psutil.Process) -> int:
    total = 0
    for member in [process, *process.children(recursive=True)]:
        try:
            total += member.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_measured(command: list[str], output: Path | None) -> dict:
    """Run ``command`` to the end, then fsync ``output``; wall seconds and peak RSS of the process tree."""
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.execvp(command[0], command)
    process = psutil.Process(pid)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                peak[0] = max(peak[0], tree_rss(process))
            except psutil.Error:
                pass
            done.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, status, usage = os.wait4(pid, 0)
    done.set()
    sampler.join()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"{' '.join(command[:5])} exited with {code}")
    if output is not None:
        fsync_tree(output)
    return {
        "seconds": round(time.perf_counter() - start, 2),
        "peak_tree_rss_bytes": peak[0],
        "ru_maxrss_bytes": usage.ru_maxrss * 1024,
    }


COUNT_IO = """
import atexit, os, sys
import moecompress.cli
from pathlib import Path
import moecompress.files as files
record, written, unwrapped = Path(sys.argv[1]), {"resume_state_bytes": 0, "spill_bytes": 0}, files.write_safetensors
def counted(path, *args, **kwargs):
    unwrapped(path, *args, **kwargs)
    kind = "spill_bytes" if "/fisher-inputs-" in str(path) else "resume_state_bytes" if "/state/" in str(path) else None
    if kind is not None:
        written[kind] += os.path.getsize(path)
files.write_safetensors = counted
for module in list(sys.modules.values()):
    if getattr(module, "write_safetensors", None) is unwrapped:
        module.write_safetensors = counted
def save():
    record.write_text(Path("/proc/self/io").read_text() + "".join(f"{k}: {v}\\n" for k, v in written.items()))
atexit.register(save)
"""
"""Child prologue: the CLI's process settings first (``moecompress.cli`` sets ``OMP_WAIT_POLICY=PASSIVE`` and
``THP_MEM_ALLOC_ENABLE=1`` before torch loads), so that a variant run through ``run_recipe`` runs as ``moecompress
run`` does (before, the chained variant ran without them: another OpenMP wait policy and 4 KiB pages); then, at exit,
write the process's I/O counters (``rchar``, ``wchar``) to the file in argv[1], with the
bytes of the safetensors files it wrote into a work directory's ``state/`` (the ``--resume`` state) and, apart,
into the Fisher sweep's spill of layer inputs (deleted as the backward consumes them; no resumed run reads it)."""

RUN_COUNTING_IO = (
    COUNT_IO
    + """
sys.argv = ["moecompress", *sys.argv[2:]]
from moecompress.cli.main import main
main()
"""
)

RUN_CHAINED_COUNTING_IO = (
    COUNT_IO
    + """
from moecompress.runner.recipes import load_recipe, run_recipe
recipe, model, out = (Path(arg) for arg in sys.argv[2:5])
run_recipe(load_recipe(recipe), model, out, progress=False, chained=True)
"""
)


def recipe_with_tokens(recipe: Path, calib_tokens: int, eval_tokens: int, target: Path) -> Path:
    """``recipe`` with its calibration and evaluation token counts replaced, written to ``target``."""
    import yaml

    document = yaml.safe_load(recipe.read_text())
    document.setdefault("calibration", {})["tokens"] = calib_tokens
    for step in document["passes"]:
        if "eval" in step:
            step["eval"] = {**(step["eval"] or {}), "tokens": eval_tokens}
    target.write_text(yaml.safe_dump(document))
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-gib", type=float, default=12.0, help="Smallest checkpoint size on disk, GiB.")
    parser.add_argument("--shard-gib", type=float, default=4.0)
    parser.add_argument("--calib-tokens", type=int, default=4096)
    parser.add_argument("--dir", type=Path, default=None, help="Where to write (default: the temporary directory).")
    parser.add_argument("--skip-prune", action="store_true")
    parser.add_argument(
        "--prune-token-weight-none",
        action="store_true",
        help="Also prune with --token-weight none (MAEP without the Fisher backward sweep), for the ratio to the "
        "default.",
    )
    parser.add_argument(
        "--with-eval",
        action="store_true",
        help="Run the quantize step with its default evaluation (the output against the input, streamed) instead "
        "of --no-eval.",
    )
    parser.add_argument(
        "--lowrank",
        action="store_true",
        help="Also quantize with --lowrank-budget 0.25 (the default fisher-token sensitivity: streamed Fisher, "
        "two calibration sweeps).",
    )
    parser.add_argument("--recipe", type=Path, default=None, help="Run this recipe on the checkpoint instead.")
    parser.add_argument("--layers", type=int, default=None, help="Decoder layers (default: enough for --min-gib).")
    parser.add_argument("--eval-tokens", type=int, default=2048, help="The recipe's evaluation tokens.")
    parser.add_argument(
        "--chained",
        action="store_true",
        help="With --recipe: run its passes chained through whole intermediate checkpoints, as recipes ran before "
        "the layer pipeline (run_recipe(chained=True)), for the before/after comparison.",
    )
    parser.add_argument(
        "--compare-chained",
        action="store_true",
        help="With --recipe: run it as one pipeline, then chained (as --chained), in this invocation, between the "
        "same two copies.",
    )
    parser.add_argument(
        "--real-vocab", action="store_true", help="Qwen3-30B-A3B's 151,936-row embedding and untied lm_head."
    )
    args = parser.parse_args()
    vocab = REAL_VOCAB if args.real_vocab else 2048
    per_layer = layer_bytes(**SHAPES)
    layers = args.layers or math.ceil(args.min_gib * 2**30 / per_layer)
    cli = [sys.executable, "-m", "moecompress.cli.main"]
    result: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.1f} GiB",
        "shapes": {**SHAPES, "layers": layers, "vocab": vocab, "tied_embeddings": not args.real_vocab},
    }
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_large_") as tmp:
        root = Path(tmp)
        source = root / "source"
        started = time.perf_counter()
        write_synthetic_qwen3_moe(
            source,
            layers,
            SHAPES["hidden"],
            SHAPES["experts"],
            SHAPES["inter"],
            resolve_model("builtin:tiny-moe"),
            heads=SHAPES["heads"],
            kv_heads=SHAPES["kv_heads"],
            head_dim=SHAPES["head_dim"],
            top_k=SHAPES["top_k"],
            max_shard_bytes=int(args.shard_gib * 2**30),
            vocab_size=vocab,
            tie_word_embeddings=not args.real_vocab,
        )
        fsync_tree(source)
        result["synthesis_seconds"] = round(time.perf_counter() - started, 1)
        result["checkpoint_bytes"] = sum(p.stat().st_size for p in source.glob("*.safetensors"))
        result["shards"] = len(list(source.glob("*.safetensors")))

        def step(name: str, command: list[str], output: Path) -> None:
            result[name] = run_measured(command, output)
            if name != "copy_1" and name != "copy_2":
                result[name]["output_bytes"] = sum(p.stat().st_size for p in output.glob("*.safetensors"))
            shutil.rmtree(output)
            print(name, json.dumps(result[name]), file=sys.stderr, flush=True)

        step("copy_1", [sys.executable, "-c", COPY, str(source), str(root / "copy")], root / "copy")
        if args.recipe is not None:
            recipe = recipe_with_tokens(args.recipe, args.calib_tokens, args.eval_tokens, root / "recipe.yaml")
            out, counters = root / "recipe_out", root / "io.txt"
            result["recipe"] = {
                "path": str(args.recipe),
                "calib_tokens": args.calib_tokens,
                "eval_tokens": args.eval_tokens,
                "chained": args.chained,
                "compare_chained": args.compare_chained,
            }
            variants = {"run_recipe": args.chained}
            if args.compare_chained:
                variants = {"run_recipe": False, "run_recipe_chained": True}
            for name, chained in variants.items():
                drop_from_page_cache(source)
                if chained:
                    command = [sys.executable, "-c", RUN_CHAINED_COUNTING_IO, str(counters), str(recipe), str(source)]
                    step(name, [*command, str(out)], out)
                else:
                    command = [sys.executable, "-c", RUN_COUNTING_IO, str(counters), "run", str(recipe)]
                    step(name, [*command, "--model", str(source), "--out", str(out), "--quiet"], out)
                io = dict(line.split(": ") for line in counters.read_text().splitlines())
                for key, counter in [("bytes_read", "rchar"), ("bytes_written", "wchar")]:
                    result[name][key] = int(io[counter])
                for key in ("resume_state_bytes", "spill_bytes"):
                    result[name][key] = int(io[key])
            step("copy_2", [sys.executable, "-c", COPY, str(source), str(root / "copy")], root / "copy")
            copy_seconds = (result["copy_1"]["seconds"] + result["copy_2"]["seconds"]) / 2
            for name in variants:
                result[name.replace("run_", "") + "_over_copy"] = round(result[name]["seconds"] / copy_seconds, 2)
            if args.compare_chained:
                result["pipeline_over_chained"] = round(
                    result["run_recipe"]["seconds"] / result["run_recipe_chained"]["seconds"], 3
                )
            print(json.dumps(result, indent=2))
            return
        quantized = root / "quantized"
        quantize_step = "quantize_mxfp4_rtn_with_eval" if args.with_eval else "quantize_mxfp4_rtn"
        step(
            quantize_step,
            [
                *cli,
                "quantize",
                str(source),
                "--out",
                str(quantized),
                "--scheme",
                "mxfp4",
                "--method",
                "rtn",
                *([] if args.with_eval else ["--no-eval"]),
            ],
            quantized,
        )
        step("copy_2", [sys.executable, "-c", COPY, str(source), str(root / "copy")], root / "copy")
        copy_seconds = (result["copy_1"]["seconds"] + result["copy_2"]["seconds"]) / 2
        result["quantize_over_copy"] = round(result[quantize_step]["seconds"] / copy_seconds, 2)
        if not args.skip_prune:
            pruned = root / "pruned"
            step(
                "prune_maep",
                [
                    *cli,
                    "prune",
                    str(source),
                    "--out",
                    str(pruned),
                    "--ratio",
                    "0.25",
                    "--calib-tokens",
                    str(args.calib_tokens),
                    "--no-eval",
                ],
                pruned,
            )
            result["prune_over_copy"] = round(result["prune_maep"]["seconds"] / copy_seconds, 2)
            if args.prune_token_weight_none:
                step(
                    "prune_maep_token_weight_none",
                    [
                        *cli,
                        *("prune", str(source), "--out", str(pruned), "--ratio", "0.25", "--token-weight", "none"),
                        *("--calib-tokens", str(args.calib_tokens), "--no-eval"),
                    ],
                    pruned,
                )
                result["prune_default_over_none"] = round(
                    result["prune_maep"]["seconds"] / result["prune_maep_token_weight_none"]["seconds"], 2
                )
        if args.lowrank:
            compensated = root / "lowrank"
            step(
                "quantize_mxfp4_lowrank",
                [
                    *cli,
                    "quantize",
                    str(source),
                    "--out",
                    str(compensated),
                    "--scheme",
                    "mxfp4",
                    "--method",
                    "rtn",
                    "--lowrank-budget",
                    "0.25",
                    "--calib-tokens",
                    str(args.calib_tokens),
                    "--no-eval",
                ],
                compensated,
            )
            result["lowrank_over_copy"] = round(result["quantize_mxfp4_lowrank"]["seconds"] / copy_seconds, 2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
