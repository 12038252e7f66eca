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
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from moecompress.checkpoint import CheckpointWriter, resolve_model

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


def synthesise(directory: Path, layers: int, hidden: int, experts: int, inter: int, vocab_dir: Path) -> dict:
    from transformers import Qwen3MoeConfig

    heads, kv_heads, head_dim = 8, 4, hidden // 8
    config = Qwen3MoeConfig(
        vocab_size=2048,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        moe_intermediate_size=inter,
        intermediate_size=4 * hidden,
        num_experts=experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    ).to_dict()
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    config["dtype"] = "bfloat16"
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=generator)).to(torch.bfloat16)

    writer = CheckpointWriter(directory, max_shard_bytes=512 * 2**20)
    writer.add(
        {"model.embed_tokens.weight": rand(2048, hidden), "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    )
    layer_bytes = 0
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors = {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
            p + "self_attn.k_norm.weight": torch.ones(head_dim, dtype=torch.bfloat16),
            p + "mlp.gate.weight": rand(experts, hidden, scale=0.5),
        }
        for e in range(experts):
            tensors[p + f"mlp.experts.{e}.gate_proj.weight"] = rand(inter, hidden)
            tensors[p + f"mlp.experts.{e}.up_proj.weight"] = rand(inter, hidden)
            tensors[p + f"mlp.experts.{e}.down_proj.weight"] = rand(hidden, inter)
        layer_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        writer.add(tensors)
        del tensors
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(vocab_dir / name, writer.work_dir / name)
    writer.finish(config)
    return {"layer_bytes": layer_bytes}


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
        shapes = synthesise(
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
