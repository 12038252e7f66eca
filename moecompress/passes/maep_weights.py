"""MAEP's token weights: how much an error at an MoE block's output costs the loss downstream.

The plain MAEP score, the mean over calibration tokens of ‖ΔH_t‖², counts an output change alike at every token.
With top-2 of 8 experts that ranks the experts as routing frequency does, and where one domain's tokens have larger
block outputs (code beside prose) it keeps that domain's experts whatever the loss says. With ``token_weight``
``fisher`` token t's ‖ΔH_t‖² is multiplied by s_t = ‖∂loss/∂y_t‖² / H, the isotropic part of the empirical Fisher
of the next-token loss at the block output y (:mod:`moecompress.quantization.sensitivity`): the score is then the
second-order estimate of the loss increase when the expert is removed, ½ Σ_t ΔH_tᵀ F_t ΔH_t with F_t ≈ s_t I.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..calibration import distributed
from ..quantization.sensitivity import (
    _batches_digest,
    block_output_fisher,
    stored_layer_sensitivity,
    stored_per_layer,
)

TOKEN_WEIGHTS: tuple[str, ...] = ("fisher", "none")
_STORED = "maep-token-weights.safetensors"


def maep_token_weights(
    model_dir: Path, batches: list[dict[str, torch.Tensor]], state_dir: Path | None = None, progress: bool = True
) -> dict[int, torch.Tensor]:
    """Per MoE layer, s_t of every token of ``batches`` in the order the measuring sweep captures them.

    A window's values depend on that window alone, so a rank that computes its own batches gets exactly the single
    process's values for them. With ``state_dir`` they are kept there and a resumed run on the same model and tokens
    takes them from there instead of running the backward sweep again."""

    def compute() -> dict[int, torch.Tensor]:
        return block_output_fisher(model_dir, batches, spill_dir=state_dir, progress=progress)

    if state_dir is None:
        return compute()
    key = f"fisher-token-raw:{Path(model_dir).absolute()}:{_batches_digest(batches)}"
    return stored_per_layer(Path(state_dir) / _STORED, key, compute)


def token_weights_for(
    config: Any, model_dir: Path, batches: list[dict[str, torch.Tensor]], state_dir: Path | None, progress: bool
) -> dict[int, torch.Tensor]:
    """:func:`maep_token_weights` where ``config`` (a :class:`~.prune_experts.PruneExpertsConfig`) asks for them,
    else nothing (every token weighs 1). Layers without weights (multi-token-prediction modules, which the
    backward sweep does not reach) are scored unweighted."""
    if config.method != "maep" or config.token_weight == "none":
        return {}
    return maep_token_weights(model_dir, batches, state_dir, progress and distributed.is_writer())


def pipeline_token_weights(config: Any, context: Any) -> dict[int, torch.Tensor]:
    """The weights for the pipeline's prune pass (``context`` a :class:`~.base.PassContext`): the quantize pass's
    ``fisher-token`` sensitivity, kept in the same file of the run's state, so that a recipe with both computes
    it once. It is s_t divided by one constant (the mean over all layers and tokens), which ranks every layer's
    experts as :func:`maep_token_weights` does."""
    if config.method != "maep" or config.token_weight == "none":
        return {}
    return stored_layer_sensitivity(
        context.state_dir / "sensitivity.safetensors",
        context.model_dir,
        context.calibration.batches,
        "fisher-token",
        context.progress,
    )
