"""Time of the low-rank compensation's whitened error spectra at Qwen3-30B-A3B's expert shapes, before and after
the row-Gram route (moecompress.quantization.lowrank.error_spectrum), measured side by side in one run.

"before" is the formulation of commit 9cfd188, written out here: float64, the Cholesky factor ``S`` of the
damped input covariance (shared by gate and up), ``E·S``, then the eigenvalues (``keep = 0``, the measuring
sweep) or eigenvectors (``keep > 0``, the rewriting sweep) of its smaller Gram matrix. "after" is
``error_spectrum`` as the low-rank pass calls it. One expert = gate [I, H], up [I, H], down [H, I] with its
routed tokens. Prints one JSON object; it also checks that both give the same σ² (relative to σ₁²).

Run: python scripts/bench_lowrank_spectra.py [--tokens 341] [--repeats 5] [--keep 16]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from moecompress.quantization.lowrank import DEFAULT_DAMP, error_spectrum

HIDDEN, INTER = 2048, 768


def _factor(inputs: torch.Tensor) -> torch.Tensor:
    x = inputs.double()
    covariance = x.T @ x / x.shape[0]
    eye = torch.eye(covariance.shape[0], dtype=torch.float64)
    return torch.linalg.cholesky(covariance + DEFAULT_DAMP * covariance.diagonal().mean() * eye)


def _before_one(error: torch.Tensor, factor: torch.Tensor, keep: int) -> torch.Tensor:
    whitened = error.double() @ factor
    gram = whitened @ whitened.T if whitened.shape[0] <= whitened.shape[1] else whitened.T @ whitened
    if keep == 0:
        return torch.linalg.eigvalsh(gram).flip(0)
    values, vectors = torch.linalg.eigh(gram)
    kept = vectors.flip(1)[:, :keep]
    if whitened.shape[0] <= whitened.shape[1]:
        right = kept.T @ whitened
        torch.linalg.solve_triangular(factor.T, right.T, upper=True)
    else:
        torch.linalg.solve_triangular(factor.T, kept, upper=True)
    return values.flip(0)


def before(expert: dict, keep: int) -> list[torch.Tensor]:
    gate_factor, down_factor = _factor(expert["x"]), _factor(expert["down_x"])
    return [
        _before_one(expert["gate"], gate_factor, keep),
        _before_one(expert["up"], gate_factor, keep),
        _before_one(expert["down"], down_factor, keep),
    ]


def after(expert: dict, keep: int) -> list[torch.Tensor]:
    return [
        error_spectrum(expert["gate"], expert["x"], keep).sigma2,
        error_spectrum(expert["up"], expert["x"], keep).sigma2,
        error_spectrum(expert["down"], expert["down_x"], keep).sigma2,
    ]


def timed(function, expert: dict, keep: int, repeats: int) -> tuple[float, list[torch.Tensor]]:
    function(expert, keep)
    started = time.perf_counter()
    for _ in range(repeats):
        result = function(expert, keep)
    return (time.perf_counter() - started) / repeats, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=341, help="routed tokens of the expert (4,096 x 8 / 96)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keep", type=int, default=16, help="components whose factors the rewriting sweep keeps")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    mixing = torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
    expert = {
        "gate": torch.randn(INTER, HIDDEN, generator=g) * 1e-3,
        "up": torch.randn(INTER, HIDDEN, generator=g) * 1e-3,
        "down": torch.randn(HIDDEN, INTER, generator=g) * 1e-3,
        "x": torch.randn(args.tokens, HIDDEN, generator=g) @ mixing,
        "down_x": torch.randn(args.tokens, INTER, generator=g).abs() ** 2 * 0.1,
    }
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "tokens": args.tokens,
    }
    for keep in (0, args.keep):
        old_seconds, old = timed(before, expert, keep, args.repeats)
        new_seconds, new = timed(after, expert, keep, args.repeats)
        worst = max(float((a.double() - b.double()).abs().max() / a[0].double()) for a, b in zip(old, new, strict=True))
        result[f"keep_{keep}"] = {
            "before_s_per_expert": round(old_seconds, 4),
            "after_s_per_expert": round(new_seconds, 4),
            "speed-up": round(old_seconds / new_seconds, 2),
            "largest_sigma2_difference_over_sigma1_2": worst,
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
