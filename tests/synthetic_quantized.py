"""Tiny checkpoints in the on-disk layouts of quantised hub releases, for tests: block-FP8 (DeepSeek-V3/R1,
Kimi-K2, Qwen3-*-FP8) and a DeepSeek-V3 multi-token-prediction layer (``model.layers.{num_hidden_layers}.*``)."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
_FP8_TARGET = re.compile(
    r"^model\.layers\.\d+\.(?:(?:self_attn|mlp)\..*_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"
)
MTP_EXTRAS = (
    "embed_tokens.weight",
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
)


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[rows, cols]`` as float8_e4m3fn codes and float32 ``weight_scale_inv`` (amax / 448 per block,
    partial last blocks included), the way DeepSeek's FP8 releases are made."""
    rows, cols = weight.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    scale = torch.empty(grid, dtype=torch.float32)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    w = weight.float()
    for i in range(grid[0]):
        for j in range(grid[1]):
            rs, cs = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            amax = float(w[rs, cs].abs().max())
            scale[i, j] = amax / FP8_MAX if amax > 0 else 1.0
            codes[rs, cs] = (w[rs, cs] / scale[i, j]).to(torch.float8_e4m3fn)
    return codes, scale


def _load_all(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _copy_side_files(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "model.safetensors.index.json":
            shutil.copy2(path, target / path.name)


def add_mtp_layer(directory: str | Path, seed: int = 0) -> Path:
    """Give a tiny DeepSeek-V3 checkpoint one MTP layer as DeepSeek-V3 ships it: a copy of the last decoder
    layer's structure (attention, router, experts, shared expert) with fresh values, plus ``embed_tokens``,
    ``enorm``, ``hnorm``, ``eh_proj`` ``[H, 2H]`` and ``shared_head.{norm,head}``; ``num_nextn_predict_layers: 1``."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    tensors = _load_all(directory)
    layers = int(config["num_hidden_layers"])
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    generator = torch.Generator().manual_seed(seed)

    def fresh(like: torch.Tensor, norm: bool) -> torch.Tensor:
        noise = torch.randn(like.shape, generator=generator)
        return (1.0 + 0.1 * noise if norm else 0.2 * noise).to(like.dtype)

    for key, value in list(tensors.items()):
        if key.startswith(last):
            tensors[mtp + key[len(last) :]] = fresh(value, value.ndim == 1 and "norm" in key)
    hidden = int(config["hidden_size"])
    embed = tensors["model.embed_tokens.weight"]
    dtype = embed.dtype
    extras = {
        "embed_tokens.weight": embed.clone(),
        "enorm.weight": fresh(torch.empty(hidden, dtype=dtype), True),
        "hnorm.weight": fresh(torch.empty(hidden, dtype=dtype), True),
        "eh_proj.weight": fresh(torch.empty(hidden, 2 * hidden, dtype=dtype), False),
        "shared_head.norm.weight": fresh(torch.empty(hidden, dtype=dtype), True),
        "shared_head.head.weight": tensors.get("lm_head.weight", embed).clone(),
    }
    tensors.update({mtp + name: value for name, value in extras.items()})
    for path in directory.glob("*.safetensors"):
        path.unlink()
    (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def convert_to_block_fp8(source: str | Path, target: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Write ``source`` (a bf16 or float32 checkpoint) as a block-FP8 release: every attention and MLP
    projection weight of the decoder layers (MTP layer included, its ``eh_proj`` and head excepted, as DeepSeek-V3
    ships them) becomes float8_e4m3fn with a float32 ``weight_scale_inv``; everything else bf16."""
    source, target = Path(source), Path(target)
    _copy_side_files(source, target)
    out: dict[str, torch.Tensor] = {}
    for key, value in _load_all(source).items():
        if _FP8_TARGET.match(key) and value.ndim == 2:
            codes, scale = quantize_block_fp8(value, block)
            out[key], out[f"{key}_scale_inv"] = codes, scale
        else:
            out[key] = value.to(torch.bfloat16) if value.is_floating_point() else value
    save_file(out, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config["quantization_config"] = dict(FP8_CONFIG, weight_block_size=list(block))
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return target
