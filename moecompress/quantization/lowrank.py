"""Load-aware low-rank compensation: after an expert matrix ``W`` is quantised to ``Q``, a rank-``r`` product
``L·R`` restores part of the error ``E = W − Q`` where the expert's inputs actually lie.

For routed inputs ``X`` with mean second moment ``C = XᵀX / n`` (damped) and its Cholesky factor ``C = S·Sᵀ``,
``‖(E − L·R)·Xᵀ‖² / n = ‖(E − L·R)·S‖²``, so the best rank-``r`` adapter comes from the SVD of the whitened error
``E·S = U Σ Vᵀ``: ``L = U_r Σ_r``, ``R = V_rᵀ S⁻¹``, leaving ``Σ_{j>r} σ_j²`` (QERA / EoRA). An expert with too few
routed tokens uses the plain SVD of ``E`` (``S = I``).

Every expert matrix (gate, up and down kept separate, so all of them cost ``rows + cols = H + I`` parameters per
rank) offers gains ``load_e · σ²_{e,j}`` in decreasing order; the load carries the matrix's reach and the
layer's downstream sensitivity (:mod:`.sensitivity`), or per-token sensitivities weight the rows of ``X``. One
budget of rank-1 components is spent on the largest gains across every matrix of every layer; since each
matrix's gains are sorted and every component costs the same, taking the largest gains overall is optimal, and
the weighted error falls strictly with each component bought (while any gain is positive).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

ALLOCATIONS: tuple[str, ...] = ("load", "uniform")
LOAD_WEIGHTINGS: tuple[str, ...] = ("tokens", "gate")
ADAPTER_BITS = 16
DEFAULT_DAMP = 1e-4


@dataclass
class ErrorSpectrum:
    """The whitened quantisation error of one matrix: ``sigma2`` (all of them, descending) and the factors of the
    first ``len(L.T)`` components."""

    sigma2: torch.Tensor
    left: torch.Tensor
    right: torch.Tensor
    whitened: bool

    def adapter(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(L [rows, rank], R [rank, cols])``."""
        if rank > self.left.shape[1]:
            raise ValueError(f"rank {rank} exceeds the {self.left.shape[1]} components kept")
        return self.left[:, :rank].contiguous(), self.right[:rank].contiguous()

    def residual(self, rank: int) -> float:
        """Predicted mean per-token squared output error left at ``rank``."""
        return float(self.sigma2[rank:].sum())


SPECTRUM_DTYPE = torch.float32
"""The spectra are computed in float32: their rounding is about ``1e-7 · σ₁²``, far below any component a rank
budget buys, and float32 is about twice as fast as float64 on CPU (scripts/bench_lowrank_spectra.py)."""


def whitening_factor(inputs: torch.Tensor, damp: float = DEFAULT_DAMP) -> torch.Tensor:
    """Lower Cholesky factor ``S`` of ``XᵀX / n + damp · mean(diag) · I`` (in the inputs' dtype)."""
    x = inputs
    covariance = x.T @ x / max(1, x.shape[0])
    mean = covariance.diagonal().mean().clamp_min(1e-30)
    eye = torch.eye(covariance.shape[0], dtype=x.dtype, device=x.device)
    for attempt in range(6):
        factor, info = torch.linalg.cholesky_ex(covariance + damp * 10**attempt * mean * eye)
        if int(info) == 0:
            return factor
    raise RuntimeError("input covariance is not positive definite even with heavy damping")


def error_spectrum(
    error: torch.Tensor, inputs: torch.Tensor | None, keep: int, damp: float = DEFAULT_DAMP
) -> ErrorSpectrum:
    """SVD of ``error`` ``[rows, cols]`` whitened by its routed ``inputs`` ``[n, cols]`` (``E·S`` with
    ``S·Sᵀ = XᵀX / n + damp · mean(diag) · I``; None: the plain SVD of ``E``); factors of the first ``keep``
    components are kept (none with ``keep == 0``, which computes only the σ²).

    With ``rows <= cols`` (gate, up) no factor ``S`` is formed: ``E·S·Sᵀ·Eᵀ = (E·Xᵀ)(E·Xᵀ)ᵀ / n + λ·E·Eᵀ`` is the
    ``rows × rows`` Gram matrix of the whitened error, whose eigenvectors ``U`` give ``L = U_k·Σ_k`` and
    ``R = Σ_k⁻¹·U_kᵀ·E`` (``= V_kᵀ·S⁻¹``), so ``L·R = U_k·U_kᵀ·E``. That skips the Cholesky factor of the
    ``cols × cols`` covariance and the ``rows × cols × cols`` product ``E·S``, about 4x less work at an expert's
    shapes. With ``rows > cols`` (down) the ``cols × cols`` factor is the small side and is used directly.
    """
    e = error.to(SPECTRUM_DTYPE)
    rows, cols = e.shape
    if inputs is None:
        return _spectrum_of(e, keep, whitened=False)
    x = inputs.to(device=e.device, dtype=SPECTRUM_DTYPE)
    if rows > cols:
        factor = whitening_factor(x, damp)
        spectrum = _spectrum_of(e @ factor, keep, whitened=True)
        if keep:
            spectrum.right = torch.linalg.solve_triangular(factor.T, spectrum.right.T, upper=True).T  # Vᵀ S⁻¹
        return spectrum
    tokens = max(1, x.shape[0])
    damping = damp * (x.pow(2).sum() / (tokens * cols)).clamp_min(1e-30)
    routed = e @ x.T
    gram = routed @ routed.T / tokens + damping * (e @ e.T)
    if keep == 0:
        sigma2 = torch.linalg.eigvalsh(gram).flip(0).clamp_min(0.0)
        return ErrorSpectrum(sigma2, *_no_factors(rows, cols, e.device), whitened=True)
    eigenvalues, vectors = torch.linalg.eigh(gram)
    sigma2 = eigenvalues.flip(0).clamp_min(0.0)
    keep = min(keep, rows)
    kept = vectors.flip(1)[:, :keep]
    sigma = sigma2[:keep].sqrt()
    right = torch.where(sigma[:, None] > 0, (kept.T @ e) / sigma.clamp_min(1e-30)[:, None], 0.0)
    return ErrorSpectrum(sigma2, kept * sigma, right, whitened=True)


def _spectrum_of(matrix: torch.Tensor, keep: int, *, whitened: bool) -> ErrorSpectrum:
    if keep == 0:
        return ErrorSpectrum(squared_singular_values(matrix), *_no_factors(*matrix.shape, matrix.device), whitened)
    return ErrorSpectrum(*truncated_svd(matrix, keep), whitened)


def _no_factors(rows: int, cols: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(rows, 0, device=device), torch.empty(0, cols, device=device)


def _gram(matrix: torch.Tensor) -> torch.Tensor:
    """The smaller of ``M·Mᵀ`` and ``Mᵀ·M``."""
    return matrix @ matrix.T if matrix.shape[0] <= matrix.shape[1] else matrix.T @ matrix


def squared_singular_values(matrix: torch.Tensor) -> torch.Tensor:
    """σ² of ``matrix``, descending, as the eigenvalues of its smaller Gram matrix.

    For an expert's shapes (768 × 2048) this is several times cheaper than an SVD. Forming the Gram matrix makes
    each σ² exact to about ``eps · σ₁²`` rather than relative to itself; components that small never win a rank
    budget.
    """
    return torch.linalg.eigvalsh(_gram(matrix)).flip(0).clamp_min(0.0)


def truncated_svd(matrix: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(σ² descending, U_k·Σ_k [rows, k], V_kᵀ [k, cols])`` with ``k = min(keep, min(rows, cols))``, from the
    eigenvectors of the smaller Gram matrix (7x faster than ``torch.linalg.svd`` at 768 × 2048).

    The other side is recovered by projecting ``matrix`` on the kept vectors, so ``U_k·Σ_k·V_kᵀ`` is exactly the
    projection of ``matrix`` on the kept subspace whatever the rounding of the vectors. A component with σ = 0
    gets a zero right vector.
    """
    eigenvalues, vectors = torch.linalg.eigh(_gram(matrix))
    sigma2 = eigenvalues.flip(0).clamp_min(0.0)
    keep = min(keep, sigma2.numel())
    kept = vectors.flip(1)[:, :keep]
    if matrix.shape[0] <= matrix.shape[1]:
        scaled_right = kept.T @ matrix  # Σ_k V_kᵀ
        sigma = scaled_right.norm(dim=1)
        right = torch.where(sigma[:, None] > 0, scaled_right / sigma.clamp_min(1e-300)[:, None], 0.0)
        return sigma2, kept * sigma, right
    return sigma2, matrix @ kept, kept.T


def weighted_error(spectra: dict, loads: dict, ranks: dict) -> float:
    return sum(loads[key] * spectrum.residual(ranks.get(key, 0)) for key, spectrum in spectra.items())


def allocate(gains: dict, loads: dict, components: int, mode: str = "load", max_rank: int | None = None) -> dict:
    """Ranks per matrix for a budget of ``components`` rank-1 components.

    ``gains[key]`` are a matrix's σ² in decreasing order and ``loads[key]`` its weight. ``load`` buys the
    largest ``load · σ²`` first (optimal for equal-cost components); ``uniform`` gives every matrix the same
    rank (the baseline). Ranks never exceed ``max_rank`` or the number of gains.
    """
    if mode not in ALLOCATIONS:
        raise ValueError(f"unknown allocation {mode!r}; choose from {ALLOCATIONS}")
    keys = list(gains)
    limit = {k: min(len(gains[k]), max_rank if max_rank is not None else len(gains[k])) for k in keys}
    ranks = dict.fromkeys(keys, 0)
    if not keys or components <= 0:
        return ranks
    if mode == "uniform":
        rank = components // len(keys)
        return {k: min(rank, limit[k]) for k in keys}
    heap = [(-loads[k] * float(gains[k][0]), i, k) for i, k in enumerate(keys) if limit[k] > 0]
    heapq.heapify(heap)
    for _ in range(components):
        if not heap:
            break
        _, i, key = heapq.heappop(heap)
        ranks[key] += 1
        if ranks[key] < limit[key]:
            heapq.heappush(heap, (-loads[key] * float(gains[key][ranks[key]]), i, key))
    return ranks
