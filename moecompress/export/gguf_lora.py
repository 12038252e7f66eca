"""Our load-aware low-rank adapters as a llama.cpp LoRA adapter file, beside a GGUF whose experts stay GGML blocks.

What llama.cpp computes (``src/llama-graph.cpp``, ``build_lora_mm_id``): for an expert tensor ``W`` with an
adapter, expert ``e``'s output gains ``scale · B_e·(A_e·x)``, one ``mul_mat_id`` per half, where ``A`` is the
tensor ``<W>.lora_a`` of numpy shape ``[experts, r, in]`` and ``B`` is ``<W>.lora_b`` ``[experts, out, r]``
(``src/llama-adapter.cpp`` checks ``A``'s ``in`` and ``B``'s ``out`` against ``W`` and that the two ``r`` agree).
The plugin adds ``x·Rᵀ·Lᵀ`` with ``L`` ``[out, r]`` and ``R`` ``[r, in]``: so ``A_e = R_e`` and ``B_e = L_e``.

Ranks differ per expert (the load-aware budget). A tensor takes the largest rank among its experts; the others'
extra rows of ``A`` and columns of ``B`` are zeros, which add nothing. The scale is ``alpha / r`` when
``adapter.lora.alpha`` is non-zero and the user's factor alone (1 for ``--lora FILE``) when it is 0: one alpha
serves the whole file while the padded ranks differ between tensors, so alpha is 0 and every tensor is scaled by
exactly 1. The factors are written in the dtype they are stored in (bf16), so ``B_e·A_e`` is our ``L_e·R_e``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from ..errors import UserInputError
from ..progress import bar as progress_bar
from .source import NativeSource

ALPHA = 0.0
_TYPES = {
    torch.bfloat16: (gguf.GGMLQuantizationType.BF16, np.uint16),
    torch.float16: (gguf.GGMLQuantizationType.F16, np.float16),
    torch.float32: (gguf.GGMLQuantizationType.F32, np.float32),
}


@dataclass(frozen=True)
class LoraTensor:
    """One adapted expert tensor: its base GGUF name, the layer and matrix, every expert's rank and the padded
    rank, the matrix's ``out`` and ``in`` widths and the stored dtype."""

    base: str
    layer: int
    matrix: str
    ranks: tuple[int, ...]
    out: int
    cols: int
    dtype: torch.dtype

    @property
    def rank(self) -> int:
        return max(self.ranks)

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        experts = len(self.ranks)
        return (experts, self.rank, self.cols), (experts, self.out, self.rank)


def default_path(out: Path) -> Path:
    """``model.gguf`` -> ``model.lora.gguf``."""
    return out.with_name(out.name.removesuffix(".gguf") + ".lora.gguf")


def plan(native: NativeSource, source: Path) -> list[LoraTensor]:
    """The adapted expert tensors, from the ranks in the checkpoint's config, each expert's ``L`` and ``R`` checked
    against the stored shapes (nothing read): a config naming adapters the checkpoint does not hold is refused."""
    out = []
    for index in native.layers:
        experts = native.quantized_experts_module(index)
        ranks = native.lowrank.get(experts or "", {})
        if experts is None or not ranks:
            continue
        count, hidden, inter = native.logical_shape(experts, "down_proj")
        for matrix in ("gate", "up", "down"):
            per_expert = tuple(int(rank) for rank in ranks.get(matrix, ()))
            if not any(per_expert):
                continue
            if len(per_expert) != count:
                raise UserInputError(f"{source}: {experts} has {count} experts but {len(per_expert)} {matrix} ranks")
            rows, cols = (hidden, inter) if matrix == "down" else (inter, hidden)
            dtypes = set()
            for expert, rank in enumerate(per_expert):
                if not rank:
                    continue
                for side, shape in (("L", (rows, rank)), ("R", (rank, cols))):
                    key = f"{experts}.lowrank.{expert}.{matrix}_{side}"
                    info = native.reader.tensors.get(key)
                    if info is None or tuple(info.shape) != shape:
                        found = "missing" if info is None else f"of shape {tuple(info.shape)}"
                        raise UserInputError(f"{source}: {key} is {found}, not {shape} as the config's ranks say")
                    dtypes.add(native.reader.dtype_of(key))
            dtype = dtypes.pop() if len(dtypes) == 1 and dtypes <= set(_TYPES) else torch.float32
            out.append(
                LoraTensor(f"blk.{index}.ffn_{matrix}_exps.weight", index, matrix, per_expert, rows, cols, dtype)
            )
    return out


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
    return tensor.contiguous().numpy()


def _factors(entry: LoraTensor, adapters: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]):
    """``A`` (the ``R`` s) and ``B`` (the ``L`` s) of one tensor, padded with zeros to its rank."""
    shape_a, shape_b = entry.shapes()
    a, b = torch.zeros(shape_a, dtype=entry.dtype), torch.zeros(shape_b, dtype=entry.dtype)
    for expert, rank in enumerate(entry.ranks):
        if not rank:
            continue
        left, right = adapters[(expert, entry.matrix)]
        a[expert, :rank] = right
        b[expert, :, :rank] = left
    return _numpy(a), _numpy(b)


def write_lora(
    native: NativeSource, tensors: list[LoraTensor], arch: str, path: Path, progress: bool
) -> dict[str, Any]:
    """Write the adapter file at ``path`` (header first from the planned shapes, then one layer's adapters at a
    time); returns the report's entry."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, ALPHA)
    for entry in tensors:
        kind, stored = _TYPES[entry.dtype]
        for suffix, shape in zip(("lora_a", "lora_b"), entry.shapes(), strict=True):
            nbytes = math.prod(shape) * np.dtype(stored).itemsize
            writer.add_tensor_info(f"{entry.base}.{suffix}", shape, np.dtype(stored), nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    layers = sorted({entry.layer for entry in tensors})
    for index in progress_bar(layers, desc="LoRA adapters", unit="layer", disable=not progress):
        adapters = native.adapters(index)
        for entry in (entry for entry in tensors if entry.layer == index):
            a, b = _factors(entry, adapters)
            writer.write_tensor_data(a)
            writer.write_tensor_data(b)
    writer.close()
    return {
        "alpha": ALPHA,
        "scale": "1: adapter.lora.alpha is 0, so llama.cpp scales each tensor by the --lora factor alone, not "
        "alpha / r",
        "how": "per adapted expert tensor W: W.lora_a [experts, r, in] holds each expert's R and W.lora_b "
        "[experts, out, r] its L (B·A = L·R), r the largest rank among the tensor's experts, smaller ranks padded "
        "with zeros; stored as the adapters are (" + ", ".join(sorted({str(e.dtype) for e in tensors})) + ")",
        "tensors": {entry.base: {"rank": entry.rank, "expert_ranks": list(entry.ranks)} for entry in tensors},
    }
