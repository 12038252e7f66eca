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


def pipeline_token_weights(config: Any, context: Any) -> dict[int, torch.Tensor]:
    """The weights for the pipeline's prune pass (``context`` a :class:`~.base.PassContext`). Where another pass
    of the stage asks for the ``fisher-token`` sensitivity (the quantize pass's low-rank budget), the pass shares
    it, kept in the same file of the run's state, so that it is computed once: s_t divided by one constant (the
    mean over all layers and tokens), which ranks every layer's experts as the raw s_t do. Otherwise the raw s_t of
    this process's share of the batches (:func:`maep_token_weights`; under torchrun each rank computes its own)."""
    if config.method != "maep" or config.token_weight == "none":
        return {}
    data = context.calibration
    shared = [
        name for name, mode in context.sensitivities.items() if mode == "fisher-token" and name != "prune_experts"
    ]
    if shared:
        return stored_layer_sensitivity(
            context.state_dir / "sensitivity.safetensors",
            context.model_dir,
            data.batches,
            "fisher-token",
            context.progress,
        )
    batches = distributed.shard_calibration(data.batches, data.tags).batches
    return maep_token_weights(context.model_dir, batches, context.state_dir, context.progress)
