"""Salient weights: the few weights of a low-bit matrix kept exactly (bf16), chosen by ``|w| · ‖x_col‖`` over the
calibration inputs the matrix really sees, and stored as a bitmap of their positions plus their values.

At about one bit per weight a plain bitmap would cost another full bit per weight; the positions are therefore
stored as a Golomb-Rice-coded bitmap (:mod:`moecompress.kernels.golomb_rice`), close to ``H(p)`` bits per position.
``raw`` stores the packed bitmap itself (one bit per position): the baseline the coded form is measured against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch

from ..kernels import golomb_rice

BitmapCode = Literal["golomb", "rice", "raw"]
BITMAP_CODES: tuple[str, ...] = get_args(BitmapCode)
VALUE_DTYPE = torch.bfloat16


@dataclass
class SalientWeights:
    """``positions``: sorted flat int64 indices into the matrix's logical shape; ``values``: bf16, one each."""

    positions: torch.Tensor
    values: torch.Tensor

    def __post_init__(self) -> None:
        if self.positions.shape != self.values.shape:
            raise ValueError(f"{self.positions.numel()} salient positions but {self.values.numel()} values")

    @property
    def count(self) -> int:
        return int(self.positions.numel())

    def apply(self, dense: torch.Tensor) -> torch.Tensor:
        """``dense`` (the dequantised matrix) with the salient weights written back in place."""
        dense.view(-1)[self.positions] = self.values.to(dense.dtype)
        return dense

    def of_expert(self, expert: int, expert_size: int, offsets: list[int] | None = None) -> SalientWeights:
        """The salient weights of leading index ``expert`` of a ``[E, ...]`` matrix, positions local to it;
        ``offsets`` (from :func:`expert_offsets`) saves the search."""
        if offsets is None:
            offsets = expert_offsets(self.positions, expert + 1, expert_size)
        lo, hi = offsets[expert], offsets[expert + 1]
        return SalientWeights(self.positions[lo:hi] - expert * expert_size, self.values[lo:hi])

    def of_experts(self, experts: list[int], expert_size: int) -> SalientWeights:
        """Leading indices ``experts`` (in that order) of a ``[E, ...]`` matrix, renumbered ``0..len-1``."""
        offsets = expert_offsets(self.positions, max(experts, default=-1) + 1, expert_size)
        parts = [self.of_expert(expert, expert_size, offsets) for expert in experts]
        positions = [part.positions + slot * expert_size for slot, part in enumerate(parts)]
        empty = self.positions[:0]
        return SalientWeights(
            torch.cat(positions) if positions else empty, torch.cat([p.values for p in parts]) if parts else empty
        )


def expert_offsets(positions: torch.Tensor, experts: int, expert_size: int) -> list[int]:
    """Where each leading index's positions start among the sorted flat ``positions`` of a ``[experts, ...]``
    matrix, and, last, where they end."""
    bounds = torch.arange(experts + 1, dtype=positions.dtype, device=positions.device) * expert_size
    return torch.searchsorted(positions, bounds).tolist()


def input_rms(inputs: list[torch.Tensor], width: int) -> torch.Tensor:
    """Per expert, the root-mean-square of each input column over its routed tokens ``[E, width]``; experts that
    received no token get ones, so their choice falls back to magnitude alone."""
    rms = torch.ones(len(inputs), width, device=inputs[0].device if inputs else "cpu")
    for expert, x in enumerate(inputs):
        if x.shape[0]:
            rms[expert] = x.float().pow(2).mean(dim=0).sqrt()
    return rms


def choose(weight: torch.Tensor, column_scale: torch.Tensor, fraction: float) -> torch.Tensor:
    """Bool mask ``[E, rows, cols]`` of the ``round(fraction · rows · cols)`` largest ``|w| · column_scale`` of each
    expert of ``weight`` ``[E, rows, cols]`` (``column_scale`` ``[E, cols]``); ties go to the lower position."""
    experts, rows, cols = weight.shape
    count = round(fraction * rows * cols)
    mask = torch.zeros(experts, rows * cols, dtype=torch.bool, device=weight.device)
    if count == 0:
        return mask.reshape(weight.shape)
    for expert in range(experts):
        score = (weight[expert].float().abs() * column_scale[expert].float()).reshape(-1)
        order = torch.argsort(score, descending=True, stable=True)
        mask[expert, order[:count]] = True
    return mask.reshape(weight.shape)


def from_mask(mask: torch.Tensor, values: torch.Tensor) -> SalientWeights:
    """The salient weights marked in ``mask``, their values taken from ``values`` (same shape)."""
    positions = torch.nonzero(mask.reshape(-1)).squeeze(-1)
    return SalientWeights(positions, values.reshape(-1)[positions].to(VALUE_DTYPE))


# ---- on disk ---------------------------------------------------------------------------------------------------
def encode_positions(positions: torch.Tensor, length: int, code: BitmapCode) -> torch.Tensor:
    """The stored bitmap (uint8) of ``positions`` among ``length`` positions."""
    indices = positions.cpu().numpy().astype(np.int64)
    if code == "raw":
        bitmap = np.zeros(length, dtype=bool)
        bitmap[indices] = True
        data = np.packbits(bitmap).tobytes()
    else:
        data = golomb_rice.encode_indices(indices, length, code=code)
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.zeros(0, dtype=torch.uint8, device="cpu")
    )


def decode_positions(stored: torch.Tensor, length: int, count: int, code: BitmapCode) -> torch.Tensor:
    """The inverse of :func:`encode_positions`, checked: exactly ``count`` positions, all below ``length``.

    Raises ``ValueError`` on a corrupt or mismatched bitmap (the coded one is decoded by the hardened decoder).
    """
    data = stored.detach().cpu().contiguous().numpy().tobytes()
    if code == "raw":
        if len(data) != (length + 7) // 8:
            raise ValueError(f"raw salient bitmap holds {len(data)} bytes, expected {(length + 7) // 8}")
        indices = np.flatnonzero(np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=length))
    else:
        declared, ones = golomb_rice.bitmap_counts(data)
        if declared != length:
            raise ValueError(f"salient bitmap covers {declared} positions, the matrix has {length}")
        if ones != count:
            raise ValueError(f"salient bitmap marks {ones} weights, the checkpoint stores {count} values")
        indices = golomb_rice.decode_indices(data)
    if indices.size != count:
        raise ValueError(f"salient bitmap marks {indices.size} weights, the checkpoint stores {count} values")
    return torch.from_numpy(indices.astype(np.int64))
