"""Parts of a quantised weight without requantising it: rows of its leading dimensions, and a prefix of its input
columns where that prefix ends on a group boundary (each group's codes and scale depend on that group alone, so
the part is exactly the quantisation of the same part of the weight). ERNIE 4.5 VL's view pads its narrower expert
set to the wider width; these cut the padding off a quantised block."""

from __future__ import annotations

import torch

from ..errors import UserInputError
from .scheme import QuantizedTensor


def _stored(qt: QuantizedTensor) -> list[torch.Tensor | None]:
    if qt.salient is not None:
        raise UserInputError(
            f"{qt.scheme.name}: salient weights are coded over a whole expert tensor, which cannot be cut into expert "
            "sets (leave salient_fraction at 0)"
        )
    return [qt.packed, qt.scales, qt.zeros]


def rows_of(qt: QuantizedTensor, experts: slice, rows: list[slice]) -> QuantizedTensor:
    """The experts ``experts`` of a ``[E, R, C]`` weight, their rows ``rows`` (slices of ``R``) concatenated."""
    parts = [
        None if t is None else torch.cat([t[experts, piece] for piece in rows], dim=1).contiguous() for t in _stored(qt)
    ]
    count = len(range(*experts.indices(qt.shape[0])))
    height = sum(len(range(*piece.indices(qt.shape[1]))) for piece in rows)
    return QuantizedTensor(qt.scheme, (count, height, qt.shape[2]), *parts)


def columns_of(qt: QuantizedTensor, experts: slice, columns: int) -> QuantizedTensor:
    """The experts ``experts`` of a ``[E, R, C]`` weight, their first ``columns`` input columns; a
    :class:`UserInputError` where ``columns`` does not end on a group of the scheme."""
    width = qt.shape[-1]
    packed, scales, zeros = _stored(qt)
    groups = scales.shape[-1]
    group = width // groups if groups and width % groups == 0 else 0
    if not group or columns % group or (columns * packed.shape[-1]) % width:
        raise UserInputError(
            f"{qt.scheme.name}: an expert set {columns} wide does not end on a group of {group or width} input "
            f"columns of the {width} wide block, so its quantised weights cannot be cut from it"
        )
    byte_columns = columns * packed.shape[-1] // width
    parts = [
        packed[experts, :, :byte_columns].contiguous(),
        scales[experts, :, : columns // group].contiguous(),
        None if zeros is None else zeros[experts, :, : columns // group].contiguous(),
    ]
    count = len(range(*experts.indices(qt.shape[0])))
    return QuantizedTensor(qt.scheme, (count, qt.shape[1], columns), *parts)
