"""GPTQ (Frantar et al., 2022) for a batch of matrices that share a shape, each with its own Hessian.

Columns are quantised left to right; each column's rounding error is spread over the columns not yet quantised
in proportion to the inverse Hessian, so that the layer's *output* on the calibration inputs moves as little as
possible. A group's grid (scale, zero point, MXFP4 exponent, or a GGML k-quant block's fields fitted with the
Hessian diagonal as importance) is fitted when the sweep reaches its first column, to the weights as corrected so
far. With an identity Hessian no error moves and the result equals round-to-nearest exactly (for the k-quants, with
unit importance), which is how experts with too few calibration tokens fall back.

Weights marked ``keep`` (salient weights) are left out of their group's grid and not rounded: their error is
zero, and the value stored for them is the one the sweep has corrected them to.
"""

from __future__ import annotations

import torch

from .salient import from_mask
from .scheme import QuantizedTensor, QuantScheme

DEFAULT_BLOCK = 128
DEFAULT_DAMP = 0.01


def inverse_hessian_factor(hessian: torch.Tensor, damp: float = DEFAULT_DAMP) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper Cholesky factor of ``H⁻¹`` per batch item ``[B, C, C]`` and the mask of dead (never active) inputs.

    ``damp`` times the mean diagonal is added first; the damping is raised until the factorisation succeeds.
    """
    hessian = hessian.double().clone()
    diagonal = torch.diagonal(hessian, dim1=-2, dim2=-1)
    dead = diagonal == 0
    diagonal[dead] = 1.0
    mean = diagonal.mean(dim=-1, keepdim=True)
    eye = torch.eye(hessian.shape[-1], dtype=hessian.dtype, device=hessian.device)
    for attempt in range(6):
        damped = hessian + (damp * 10**attempt) * mean.unsqueeze(-1) * eye
        factor, info = torch.linalg.cholesky_ex(damped)
        if not bool(info.any()):
            break
    else:
        raise RuntimeError("GPTQ: the Hessian is not positive definite even with heavy damping")
    inverse = torch.cholesky_inverse(factor)
    upper = torch.linalg.cholesky(inverse, upper=True)
    return upper.float(), dead


def hessian_importance(hessian: torch.Tensor) -> torch.Tensor:
    """Each input column's weight in a weighted grid fit ``[B, 1, C]``: the Hessian diagonal normalised to mean 1
    per batch item and floored at 1e-6, as the calibrated RTN's importance; all ones for an identity Hessian."""
    diagonal = torch.diagonal(hessian, dim1=-2, dim2=-1).double()
    mean = diagonal.mean(dim=-1, keepdim=True)
    normalised = torch.where(mean > 0, diagonal / torch.where(mean > 0, mean, 1.0), 1.0)
    return normalised.clamp_min(1e-6).float().unsqueeze(1)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scheme: QuantScheme,
    *,
    block_size: int = DEFAULT_BLOCK,
    damp: float = DEFAULT_DAMP,
    keep: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantise ``weight`` ``[B, rows, cols]`` with per-item Hessians ``[B, cols, cols]`` (``X^T X`` of the inputs);
    ``keep`` (bool, like ``weight``) marks salient weights stored exactly. ``block_size`` (the lazy batch of
    columns) is rounded down to a multiple of the grid's width, at least one width."""
    kind = scheme.kind
    batch, rows, cols = weight.shape
    if hessian.shape != (batch, cols, cols):
        raise ValueError(f"Hessian shape {tuple(hessian.shape)} does not fit weight {tuple(weight.shape)}")
    group = kind.gptq_width(scheme, cols)
    if cols % group:
        raise ValueError(f"{scheme.name}: the input dimension {cols} is not a multiple of {group}")
    block_size = max(group, block_size - block_size % group)
    importance = hessian_importance(hessian)
    hinv, dead = inverse_hessian_factor(hessian, damp)
    work = weight.float().clone()
    work.masked_fill_(dead.unsqueeze(1), 0.0)
    codes = torch.zeros(batch, rows, cols, dtype=torch.uint8, device=weight.device)
    kept_values = None if keep is None else torch.zeros(batch, rows, cols, device=weight.device)
    grids = []
    for start in range(0, cols, block_size):
        stop = min(start + block_size, cols)
        block = work[:, :, start:stop].clone()
        errors = torch.zeros_like(block)
        hinv_block = hinv[:, start:stop, start:stop]
        for i in range(stop - start):
            if i % group == 0:
                columns = slice(start + i, start + i + group)
                exclude = None if keep is None else keep[:, :, columns]
                grid = kind.gptq_fit(scheme, block[:, :, i : i + group], exclude, importance[:, :, columns])
                grids.append(grid)
            column_codes, quantized = kind.gptq_round(scheme, block[:, :, i], grid, i % group)
            if keep is not None:
                quantized = torch.where(keep[:, :, start + i], block[:, :, i], quantized)
                kept_values[:, :, start + i] = block[:, :, i]
            codes[:, :, start + i] = column_codes
            error = (block[:, :, i] - quantized) / hinv_block[:, i, i].unsqueeze(-1)
            block[:, :, i:] -= error.unsqueeze(-1) * hinv_block[:, i, i:].unsqueeze(1)
            errors[:, :, i] = error
        work[:, :, stop:] -= errors @ hinv[:, start:stop, stop:]
    salient = None if keep is None else from_mask(keep, kept_values)
    stored = kind.gptq_pack(scheme, codes, grids)
    if stored is None:
        return scheme.pack(codes, scheme.stack_grids(grids), salient)
    return QuantizedTensor(scheme, tuple(codes.shape), *stored, salient)
