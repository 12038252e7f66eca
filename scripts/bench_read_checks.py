"""What the checks made on opening a checkpoint cost, and how fast an unreachable Hub is given up (issue 40).

1. A DeepSeek-V3-sized header (61 layers, 256 routed experts: 44,787 tensors) built in memory: the time to parse
   it (json.loads, which every open pays anyway) beside the time of check_header and check_against_config.
2. A hub id with the Hub unreachable (HF_ENDPOINT on a closed local port), in a child process each: the first
   request as moecompress made it before (hf_hub_download of the index, with huggingface_hub's retries) beside
   resolve_model now (one request with a short timeout, then the cache).

    python scripts/bench_read_checks.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moecompress.checkpoint.consistency import check_against_config, check_header
from moecompress.checkpoint.reader import TensorInfo
from moecompress.families import adapter_for

LAYERS, DENSE, EXPERTS, HIDDEN, WIDTH, VOCAB = 61, 3, 256, 7168, 2048, 129280


def deepseek_v3_header() -> tuple[dict, dict, int, dict]:
    """(config, header, data bytes, tensors) of a DeepSeek-V3-shaped checkpoint as one shard."""
    config = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": LAYERS,
        "first_k_dense_replace": DENSE,
        "n_routed_experts": EXPERTS,
        "num_experts_per_tok": 8,
        "hidden_size": HIDDEN,
        "moe_intermediate_size": WIDTH,
        "vocab_size": VOCAB,
        "num_attention_heads": 128,
    }
    names = [("model.embed_tokens.weight", (VOCAB, HIDDEN)), ("lm_head.weight", (VOCAB, HIDDEN))]
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        names += [
            (prefix + "self_attn.q_a_proj.weight", (1536, HIDDEN)),
            (prefix + "input_layernorm.weight", (HIDDEN,)),
        ]
        if layer < DENSE:
            names.append((prefix + "mlp.gate_proj.weight", (18432, HIDDEN)))
            continue
        names += [
            (prefix + "mlp.gate.weight", (EXPERTS, HIDDEN)),
            (prefix + "mlp.gate.e_score_correction_bias", (EXPERTS,)),
        ]
        for expert in range(EXPERTS):
            for name, shape in (
                ("gate_proj", (WIDTH, HIDDEN)),
                ("up_proj", (WIDTH, HIDDEN)),
                ("down_proj", (HIDDEN, WIDTH)),
            ):
                names.append((f"{prefix}mlp.experts.{expert}.{name}.weight", shape))
    header, tensors, offset = {}, {}, 0
    for key, shape in names:
        size = 2
        for dim in shape:
            size *= dim
        header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        tensors[key] = TensorInfo("model.safetensors", "BF16", shape)
        offset += size
    return config, header, offset, tensors


def median_seconds(function, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


_CHILD = """
import sys, time
mode = sys.argv[1]
if mode == "before":
    from huggingface_hub import hf_hub_download
    call = lambda: hf_hub_download("no-such-org/no-such-model", "model.safetensors.index.json")
else:
    from moecompress.checkpoint import resolve_model
    call = lambda: resolve_model("no-such-org/no-such-model")
start = time.perf_counter()
try:
    call()
except Exception as error:
    print(type(error).__name__, file=sys.stderr)
print(f"{time.perf_counter() - start:.2f}")
"""


def unreachable_hub_seconds(mode: str) -> float:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_CACHE": cache}
        done = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, env=env)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    config, header, data_len, tensors = deepseek_v3_header()
    raw = json.dumps(header).encode()
    adapter = adapter_for(config)
    parse = median_seconds(lambda: json.loads(raw))
    headers = median_seconds(lambda: check_header(Path("model.safetensors"), header, data_len))
    against = median_seconds(lambda: check_against_config(adapter, tensors, "model"))
    print(f"{len(tensors)} tensors, {len(raw) / 1e6:.1f} MB header; medians of 3")
    print(f"  json.loads of the header     {parse * 1000:7.0f} ms")
    print(f"  check_header                 {headers * 1000:7.0f} ms  ({headers / parse:.2f}x the parse)")
    print(f"  check_against_config         {against * 1000:7.0f} ms  ({against / parse:.2f}x the parse)")
    before, now = unreachable_hub_seconds("before"), unreachable_hub_seconds("now")
    print("hub id, Hub unreachable (connection refused), one call each")
    print(f"  before: hf_hub_download with retries   {before:6.2f} s")
    print(f"  now: resolve_model                     {now:6.2f} s  ({before / now:.0f}x faster)")


if __name__ == "__main__":
    main()
