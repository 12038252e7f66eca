"""GGML's k-quants (``q2_k`` .. ``q6_k``): 256-weight super-blocks with quantised sub-block scales (and mins),
held in our checkpoints as GGML's own bytes (the quant fields in ``packed``, the scale fields in ``_scales``, each
in GGML's field order; :func:`~.ggml_blocks.ggml_bytes` joins them into the blocks GGUF stores).

Rows whose width is not a multiple of 256 take the type llama.cpp's quantiser itself falls back to
(``tensor_type_fallback`` in src/llama-quant.cpp of the llama.cpp that llama-cpp-python 0.3.36 vendors): Q2_K and
Q3_K → Q4_0, Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, all 32-weight blocks (earlier llama.cpp took IQ4_NL for Q2_K and
Q3_K). llama.cpp writes F16 where the width is not even a multiple of 32; that width is refused here.

RTN rounds every weight against the fields fitted to the block; with calibration (``importance``: the routed
tokens' input second moments per column, GPTQ's Hessian diagonal) each sub-block's scale and min minimise the
importance-weighted error. GPTQ fits a block's fields the same way (the Hessian diagonal as importance) when its
sweep reaches the block's first column, on the weights as corrected so far, then rounds each column against the
sub-block's decoded scale and min, the values GGML reconstructs, and spreads the error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import SchemeKind, register
from .ggml_blocks import FORMATS, QK_K, BlockFormat, fields_of, ggml_bytes, join, split

FALLBACK_BLOCK = 32


@dataclass(frozen=True)
class BlockGrid:
    """One block column's fitted fields for GPTQ: the scale fields ``[..., rows, bytes]`` as stored and each
    sub-block's decoded step and offset ``[..., rows, sub-blocks]``."""

    fmt: BlockFormat
    scales: torch.Tensor
    step: torch.Tensor
    offset: torch.Tensor | None


class KQuant(SchemeKind):
    main: str
    fallback: str
    group_sizes = (QK_K,)
    default_group_size = QK_K
    fixed_group_size = QK_K
    scale_dtype = torch.uint8

    def check(self, scheme) -> None:
        if scheme.group_size != QK_K:
            raise ValueError(f"{self.name} super-blocks are {QK_K} wide, not {scheme.group_size}")

    def describe(self, scheme) -> str:
        return f"{self.name} (GGML {self.main} super-blocks of {QK_K}, {self.fallback} for other widths"

    def width_problem(self, scheme, cols: int) -> str | None:
        if cols % FALLBACK_BLOCK:
            return (
                f"{self.name}: the input dimension {cols} is not a multiple of {FALLBACK_BLOCK} (llama.cpp would "
                "write F16 there)"
            )
        return None

    def block_format(self, cols: int) -> BlockFormat:
        return FORMATS[self.main if cols % QK_K == 0 else self.fallback]

    ggml_own_blocks = True

    def ggml_block_type(self, scheme, has_zeros, cols):
        return self.block_format(cols).name

    def stored_shapes(self, scheme, shape):
        *lead, cols = shape
        fmt = self.block_format(cols)
        blocks = cols // fmt.block
        return {
            "": ((*lead, blocks * fmt.part_bytes("q")), torch.uint8),
            "_scales": ((*lead, blocks * fmt.part_bytes("s")), torch.uint8),
        }

    def logical_cols(self, scheme, packed_cols, scales_cols=None):
        for name in (self.main, self.fallback):
            fmt = FORMATS[name]
            quant, scale = fmt.part_bytes("q"), fmt.part_bytes("s")
            if packed_cols % quant == 0 and (scales_cols is None or scales_cols * quant == packed_cols * scale):
                cols = packed_cols // quant * fmt.block
                if self.block_format(cols) is fmt:
                    return cols
        raise ValueError(f"{self.name}: {packed_cols} packed bytes per row fit neither {self.main} nor {self.fallback}")

    def quantize(self, scheme, weight, importance=None):
        *lead, cols = weight.shape
        problem = self.width_problem(scheme, cols)
        if problem:
            raise ValueError(problem)
        fmt = self.block_format(cols)
        x = weight.float().reshape(-1, fmt.block)
        w = torch.ones_like(x) if importance is None else importance.float().expand(weight.shape).reshape(x.shape)
        quants, scales = split(fmt, fmt.encode(x, w))
        rows = [*lead, -1]
        return quants.reshape(rows), scales.reshape(rows), None

    def gptq_width(self, scheme, cols):
        problem = self.width_problem(scheme, cols)
        if problem:
            raise ValueError(problem)
        return self.block_format(cols).block

    def gptq_fit(self, scheme, block, exclude, importance):
        *lead, width = block.shape
        fmt = self.block_format(width)
        w = importance.float().expand(block.shape)
        if exclude is not None:
            w = torch.where(exclude, torch.zeros((), dtype=torch.float32), w)
        scale_fields, step, offset = fmt.fit(block.reshape(-1, width), w.reshape(-1, width))
        return BlockGrid(
            fmt,
            join(fmt, scale_fields, "s").reshape(*lead, -1),
            step.reshape(*lead, -1),
            None if offset is None else offset.reshape(*lead, -1),
        )

    def gptq_round(self, scheme, column, grid, index):
        sub = index // grid.fmt.sub
        step = grid.step[..., sub]
        offset = None if grid.offset is None else grid.offset[..., sub]
        codes = grid.fmt.codes(column, step, offset)
        return codes, grid.fmt.values(codes, step, offset)

    def gptq_pack(self, scheme, codes, grids):
        *lead, cols = codes.shape
        fmt = self.block_format(cols)
        quants = join(fmt, fmt.pack(codes.reshape(-1, fmt.block)), "q").reshape(*lead, -1)
        return quants, torch.cat([grid.scales for grid in grids], dim=-1), None

    def dequantize(self, q, dtype):
        cols = q.shape[-1]
        fmt = self.block_format(cols)
        quants = q.packed.reshape(-1, fmt.part_bytes("q"))
        scales = q.scales.reshape(-1, fmt.part_bytes("s"))
        return fmt.decode(fields_of(fmt, quants, scales)).reshape(q.shape).to(dtype)

    def ggml_blocks(self, q):
        fmt = self.block_format(q.shape[-1])
        quants = q.packed.reshape(-1, fmt.part_bytes("q"))
        scales = q.scales.reshape(-1, fmt.part_bytes("s"))
        return fmt.name, ggml_bytes(fmt, quants, scales).reshape(*q.shape[:-1], -1)


@register
class Q2K(KQuant):
    name, bits, main, fallback = "q2_k", 2, "Q2_K", "Q4_0"


@register
class Q3K(KQuant):
    name, bits, main, fallback = "q3_k", 3, "Q3_K", "Q4_0"


@register
class Q4K(KQuant):
    name, bits, main, fallback = "q4_k", 4, "Q4_K", "Q5_0"


@register
class Q5K(KQuant):
    name, bits, main, fallback = "q5_k", 5, "Q5_K", "Q5_1"


@register
class Q6K(KQuant):
    name, bits, main, fallback = "q6_k", 6, "Q6_K", "Q8_0"
