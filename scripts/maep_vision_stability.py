"""Is MAEP's low-attention-vision expert ranking stable across calibration sets? Measure it.

For a Qwen3-VL-MoE checkpoint (default: a seeded random tiny one built here, 16 experts per layer), the MAEP pruning
signal (mean Delta-H over the lowest-attention vision tokens) and preservation signal (text tokens) are computed
on two calibration sources; per layer, the Spearman rank correlation of the experts' rankings is printed, with
two references: the same source under another seed, and a shuffled ranking (expected near 0).

Run: python scripts/maep_vision_stability.py [--model DIR] [--images 24] [--image-size 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from moecompress.calibration.model_inputs import calibration_batches
from moecompress.loading import load_adapter, quiet_transformers
from moecompress.passes.prune_experts import PruneExpertsConfig, score_layer
from moecompress.sweep.engine import CalibrationSweep


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    rank_a = a.argsort().argsort().float()
    rank_b = b.argsort().argsort().float()
    rank_a, rank_b = rank_a - rank_a.mean(), rank_b - rank_b.mean()
    return float((rank_a * rank_b).sum() / (rank_a.norm() * rank_b.norm()))


def signals(
    model_dir: Path, source: str, seed: int, image_size: int, fraction: float
) -> dict[int, dict[str, torch.Tensor]]:
    adapter = load_adapter(model_dir)
    config = PruneExpertsConfig(method="maep", prune_tags=("vision",), low_attention_fraction=fraction, seed=seed)
    batches, tags, names = calibration_batches(adapter, model_dir, source, 0, 0, 1, seed, image_size)
    sweep = CalibrationSweep(model_dir, batches, tags, names, capture_attention=True, progress=False)
    out = {}
    for capture in sweep.run():
        scores = score_layer(adapter, capture, config)
        out[capture.layer] = {
            "prune": torch.tensor(scores.extra["prune_signal"]),
            "preserve": torch.tensor(scores.extra["preserve_signal"]),
        }
    return out


def build_default_model(directory: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from synthetic import TINY_CONFIGS, save_tiny_source

    TINY_CONFIGS["qwen3_vl_moe"]["text_config"].update(num_experts=16, num_hidden_layers=3)
    path = save_tiny_source("qwen3_vl_moe", directory, seed=0)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--images", type=int, default=24)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--low-attention-fraction", type=float, default=0.5)
    args = parser.parse_args()
    quiet_transformers()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_default_model(Path(tmp) / "tiny-vl")
        runs = {
            "shapes_seed0": signals(
                model_dir, f"builtin:shapes:{args.images}", 0, args.image_size, args.low_attention_fraction
            ),
            "shapes_seed1": signals(
                model_dir, f"builtin:shapes:{args.images}", 1, args.image_size, args.low_attention_fraction
            ),
            "stripes_seed0": signals(
                model_dir, f"builtin:stripes:{args.images}", 0, args.image_size, args.low_attention_fraction
            ),
        }
    generator = torch.Generator().manual_seed(0)
    layers = {}
    for layer in runs["shapes_seed0"]:
        a, b, c = (runs[name][layer] for name in ("shapes_seed0", "shapes_seed1", "stripes_seed0"))
        shuffled = a["prune"][torch.randperm(a["prune"].numel(), generator=generator)]
        layers[str(layer)] = {
            "prune_signal_shapes_vs_stripes": round(spearman(a["prune"], c["prune"]), 4),
            "prune_signal_shapes_seed0_vs_seed1": round(spearman(a["prune"], b["prune"]), 4),
            "preserve_signal_shapes_vs_stripes": round(spearman(a["preserve"], c["preserve"]), 4),
            "prune_signal_vs_shuffled": round(spearman(a["prune"], shuffled), 4),
        }
    mean = {key: round(sum(v[key] for v in layers.values()) / len(layers), 4) for key in next(iter(layers.values()))}
    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "model": str(args.model or "tiny random Qwen3-VL-MoE, 16 experts"),
                "images_per_source": args.images,
                "image_size": args.image_size,
                "low_attention_fraction": args.low_attention_fraction,
                "spearman_by_layer": layers,
                "spearman_mean": mean,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
