"""Our quantised expert matrices as GGML block tensors, and how far GGML's values are from ours.

GGML blocks hold 32 consecutive weights of a row; a 4-bit block stores weight ``j`` in the low nibble of byte
``j`` and weight ``j + 16`` in its high nibble (ours: weights ``2k`` and ``2k + 1`` share byte ``k``).

- MXFP4 → ``MXFP4`` (``block_mxfp4``: the E8M0 scale byte, then 16 bytes of E2M1 codes). GGML's code table is
  ours doubled and its scale ``2**(e - 127) / 2``, so the codes and the scale byte copy over unchanged: exact.
- Integer grids (INT4/INT2, binary) → ``Q4_0`` (``d`` fp16, value ``(q - 8)·d``) when the zero point is fixed,
  ``Q4_1`` (``d``, ``m`` fp16, value ``q·d + m``) when it is stored per group. A group of 64 or 128 becomes 2 or 4
  blocks with the same scale. The codes map exactly (``q = code - z + 8`` for Q4_0); the differences are the fp16
  rounding of a bf16 scale outside fp16's range (or subnormal), of Q4_1's ``m = -z·s``, and our rounding of the
  product to bf16, which GGML does not do. :func:`measure` reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..quantization.scheme import QuantizedTensor

QK = 32


@dataclass(frozen=True)
class GGMLTensor:
    """Raw GGML blocks ``[..., rows, cols / 32 * block_bytes]`` (uint8) of a ``[..., rows, cols]`` weight."""

    type_name: str
    blocks: np.ndarray


def ggml_type_for(q: QuantizedTensor) -> str:
    """The GGML block type that holds ``q``'s codes and grid (``MXFP4``, ``Q4_0`` or ``Q4_1``)."""
    scheme = q.scheme
    if scheme.is_float:
        return "MXFP4"
    if scheme.is_binary or q.zeros is None:
        return "Q4_0"
    return "Q4_1"


def _ggml_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``[..., n·32]`` → GGML's packing ``[..., n, 16]`` (weight j low, j + 16 high)."""
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, QK)
    return grouped[..., : QK // 2] | (grouped[..., QK // 2 :] << 4)


def _per_block(scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group values ``[..., cols / group]`` repeated for each 32-wide block of the group."""
    return scales.repeat_interleave(group_size // QK, dim=-1)


def _fp16_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).contiguous().view(torch.uint8).reshape(*values.shape, 2)


def to_ggml(q: QuantizedTensor) -> GGMLTensor:
    """``q`` (salient weights not allowed: GGML has no place for them) as GGML blocks."""
    if q.salient is not None:
        raise ValueError("a matrix with salient weights has no GGML block type; fold it into a dense tensor")
    type_name = ggml_type_for(q)
    codes = q.codes()
    scheme = q.scheme
    if type_name == "MXFP4":
        blocks = torch.cat([q.scales.unsqueeze(-1), _ggml_nibbles(codes)], dim=-1)
        return GGMLTensor(type_name, blocks.reshape(*q.shape[:-1], -1).numpy())
    if scheme.is_binary:
        quants, scale = codes * 2 + 7, q.scales.float()
    else:
        quants, scale = codes, q.scales.float()
    if type_name == "Q4_0":
        if not scheme.is_binary:
            quants = codes.to(torch.int16) - 2 ** (scheme.bits - 1) + 8
        d = _fp16_bytes(_per_block(scale, scheme.group_size))
        nibbles = _ggml_nibbles(quants.to(torch.uint8))
        blocks = torch.cat([d, nibbles], dim=-1)
    else:
        m = -(q.zeros.float() * scale)
        d = _fp16_bytes(_per_block(scale, scheme.group_size))
        m = _fp16_bytes(_per_block(m, scheme.group_size))
        blocks = torch.cat([d, m, _ggml_nibbles(quants)], dim=-1)
    return GGMLTensor(type_name, blocks.reshape(*q.shape[:-1], -1).numpy())


@dataclass(frozen=True)
class BlockError:
    """How GGML's dequantised values differ from ours over one matrix (all zero: exact)."""

    max_abs: float
    max_rel: float
    """Largest ``|ggml - ours| / |ours|`` over the weights where ours is non-zero."""
    mismatched: int
    numel: int

    @property
    def exact(self) -> bool:
        return self.mismatched == 0

    def to_dict(self) -> dict[str, float | int | bool]:
        return {
            "exact": self.exact,
            "max_abs_error": self.max_abs,
            "max_rel_error": self.max_rel,
            "mismatched_weights": self.mismatched,
            "weights": self.numel,
        }


def ggml_dequantize(tensor: GGMLTensor) -> np.ndarray:
    """GGML's float32 values of ``tensor``, by the gguf package's own reference (``gguf.quants``)."""
    import gguf

    return gguf.quants.dequantize(tensor.blocks, gguf.GGMLQuantizationType[tensor.type_name])


def compare(ggml_values: np.ndarray, ours: torch.Tensor) -> BlockError:
    theirs = torch.from_numpy(np.ascontiguousarray(ggml_values)).float().reshape(ours.shape)
    ours = ours.float()
    diff = (theirs - ours).abs()
    nonzero = ours != 0
    rel = diff[nonzero] / ours[nonzero].abs()
    return BlockError(
        float(diff.max()) if diff.numel() else 0.0,
        float(rel.max()) if rel.numel() else 0.0,
        int((diff > 0).sum()),
        ours.numel(),
    )


def measure(q: QuantizedTensor, tensor: GGMLTensor) -> BlockError:
    """GGML's values of ``tensor`` against ``q.dequantize()`` (what our model computes with)."""
    return compare(ggml_dequantize(tensor), q.dequantize())
