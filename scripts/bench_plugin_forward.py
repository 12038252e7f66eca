"""Is the plugin's CPU forward as fast as bf16? Greedy decode and prefill of one Qwen3-30B-A3B-shaped layer, in
transformers, for the bf16 original and its MXFP4 and INT4 native outputs (loaded after ``import moecompress``).

Synthesises a random bf16 Qwen3-MoE checkpoint (default: one layer of 128 experts of 2048 x 768, top-8, 32 query
and 4 KV heads of 128), quantises it with RTN to MXFP4 and to INT4 (group ``--group-size``) in the native format,
loads all three with ``AutoModelForCausalLM.from_pretrained`` and times, round-robin over the models
(``--rounds`` times, the median reported, so machine noise hits all three alike):

- decode: ``--new-tokens`` greedy steps after an ``--prompt``-token prompt, one token per forward with the KV
  cache (tokens/s);
- prefill: one forward of ``--prefill`` tokens without the cache (seconds).

Prints one JSON object with the figures and the ratios to bf16 (decode: quantised over bf16 tokens/s, higher is
better; prefill: quantised over bf16 seconds, lower is better), from wall time, and the process CPU seconds beside
them (on a shared machine the steadier of the two).

Run: python scripts/bench_plugin_forward.py [--layers 1] [--threads 2] [--rounds 3] [--profile mxfp4]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import moecompress  # noqa: F401  (registers the native format with transformers)
from moecompress.loading import quiet_transformers
from moecompress.passes.quantize import QuantizeConfig, quantize_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synthetic import write_synthetic_qwen3_moe

QWEN3_30B_A3B = dict(hidden=2048, experts=128, inter=768, heads=32, kv_heads=4, head_dim=128, top_k=8)


@torch.inference_mode()
def decode_seconds(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """Wall and process CPU seconds for ``new_tokens`` greedy one-token forwards after ``prompt`` (the prompt's
    own forward untimed)."""
    out = model(prompt, use_cache=True)
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(new_tokens):
        out = model(token, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    return time.perf_counter() - start, time.process_time() - cpu


@torch.inference_mode()
def prefill_seconds(model, tokens: torch.Tensor) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    model(tokens, use_cache=False)
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=128, help="INT4 group size (32, 64 or 128).")
    parser.add_argument("--prompt", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prefill", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="Where to write (default: a temporary directory).")
    parser.add_argument(
        "--profile", choices=("bf16", "mxfp4", "int4"), default=None, help="Print a cProfile of one model's timings."
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_transformers()
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        source = root / "bf16"
        shape = dict(QWEN3_30B_A3B)
        write_synthetic_qwen3_moe(
            source,
            args.layers,
            shape.pop("hidden"),
            shape.pop("experts"),
            shape.pop("inter"),
            **shape,
        )
        outputs = {"bf16": source}
        for name, config in (
            ("mxfp4", QuantizeConfig(scheme="mxfp4")),
            ("int4", QuantizeConfig(scheme="int4", group_size=args.group_size)),
        ):
            outputs[name] = root / name
            quantize_checkpoint(source, outputs[name], config, eval_data=None, progress=False)
        models = {
            name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
            for name, path in outputs.items()
        }

        vocab = models["bf16"].config.vocab_size
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, vocab, (1, args.prompt), generator=generator)
        prefill = torch.randint(0, vocab, (1, args.prefill), generator=generator)
        for model in models.values():  # warm-up: first-call allocations and caches
            decode_seconds(model, prompt, 2)
            prefill_seconds(model, prefill)

        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            decode_seconds(models[args.profile], prompt, args.new_tokens)
            prefill_seconds(models[args.profile], prefill)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)

        decode = {name: [] for name in models}
        fill = {name: [] for name in models}
        for _ in range(args.rounds):
            for name, model in models.items():
                decode[name].append(decode_seconds(model, prompt, args.new_tokens))
                fill[name].append(prefill_seconds(model, prefill))

    decode_tps = {name: args.new_tokens / statistics.median(v[0] for v in values) for name, values in decode.items()}
    decode_cpu = {name: statistics.median(v[1] for v in values) / args.new_tokens for name, values in decode.items()}
    prefill_s = {name: statistics.median(v[0] for v in values) for name, values in fill.items()}
    prefill_cpu = {name: statistics.median(v[1] for v in values) for name, values in fill.items()}
    result = dict(
        date=time.strftime("%Y-%m-%d"),
        machine=f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
        torch=torch.__version__,
        shape=dict(QWEN3_30B_A3B, layers=args.layers, int4_group_size=args.group_size),
        decode_tokens_per_s={name: round(value, 3) for name, value in decode_tps.items()},
        prefill_seconds={name: round(value, 3) for name, value in prefill_s.items()},
        decode_cpu_seconds_per_token={name: round(value, 4) for name, value in decode_cpu.items()},
        prefill_cpu_seconds={name: round(value, 3) for name, value in prefill_cpu.items()},
        decode_over_bf16={name: round(decode_tps[name] / decode_tps["bf16"], 3) for name in ("mxfp4", "int4")},
        prefill_over_bf16={name: round(prefill_s[name] / prefill_s["bf16"], 3) for name in ("mxfp4", "int4")},
        rounds_wall_cpu_seconds={"decode": decode, "prefill": fill},
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
