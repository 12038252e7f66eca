"""How much an error at each MoE block's output costs downstream: the empirical Fisher of the calibration loss with
respect to the block output.

An error ``δ_t`` added to block ``l``'s output at token ``t`` raises the loss by about ``½ δ_tᵀ F_l δ_t``, with
``F_l = E[g gᵀ]`` and ``g = ∂loss/∂y_l``. The low-rank allocation measures ``‖δ‖²`` only, so the isotropic part
of ``F_l``, ``s_l = E_t ‖g_t‖² / H``, is the factor that makes the gains of different layers comparable: it sees
that an early layer's error passes through every later layer before it reaches the loss.

The gradient pass loads the whole model once (on the GPUs with ``device_map="auto"`` where there are any).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError

from ..families import FamilyAdapter
from ..loading import load_model
from ..sweep_state import load_with_metadata, save_atomically

SENSITIVITIES: tuple[str, ...] = ("none", "fisher", "fisher-token")


def block_output_fisher(
    model: torch.nn.Module, adapter: FamilyAdapter, batches: list[dict[str, torch.Tensor]]
) -> dict[int, torch.Tensor]:
    """``‖∂loss/∂y_{l,t}‖² / H`` for every MoE layer ``l`` and calibration token ``t`` (in the order of the
    concatenated batches, as the calibration sweep captures them); the loss is the summed next-token negative
    log-likelihood, so each token's gradient does not shrink with the batch size."""
    layers = adapter.moe_layers()
    squares: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    handles = []

    def watch(layer: int):
        def hook(_module, _args, output):
            out = output[0] if isinstance(output, tuple) else output

            def record(grad: torch.Tensor) -> None:
                squares[layer].append(grad.float().pow(2).mean(dim=-1).reshape(-1).cpu())

            out.register_hook(record)

        return hook

    for layer in layers:
        handles.append(adapter.moe_block_of(model, layer).register_forward_hook(watch(layer)))
    device = next(model.parameters()).device
    try:
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = model(**batch, use_cache=False).logits.float()
            ids = batch["input_ids"]
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
            )
            model.zero_grad(set_to_none=True)
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return {layer: torch.cat(values) for layer, values in squares.items()}


def layer_sensitivity(
    model_dir: Path, adapter: FamilyAdapter, batches: list[dict[str, torch.Tensor]], mode: str
) -> dict[int, torch.Tensor]:
    """Per MoE layer, the factor on its error: nothing for ``none``; for ``fisher`` its mean Fisher (a scalar
    tensor), for ``fisher-token`` every token's. Both are divided by the mean over all layers and tokens, as only
    ratios matter to the allocation."""
    if mode not in SENSITIVITIES:
        raise ValueError(f"unknown sensitivity {mode!r}; choose from {SENSITIVITIES}")
    if mode == "none":
        return {}
    device_map = "auto" if torch.cuda.is_available() else None
    model = load_model(model_dir, adapter, device_map=device_map)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    model.get_input_embeddings().weight.requires_grad_(True)
    fisher = block_output_fisher(model, adapter, batches)
    del model
    mean = float(torch.cat(list(fisher.values())).double().mean().clamp_min(1e-30))
    if mode == "fisher":
        return {layer: (values.double().mean() / mean).float() for layer, values in fisher.items()}
    return {layer: values / mean for layer, values in fisher.items()}


def _batches_digest(batches: list[dict[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256()
    for batch in batches:
        ids = batch["input_ids"].contiguous()
        digest.update(str(tuple(ids.shape)).encode())
        digest.update(ids.numpy().tobytes())
    return digest.hexdigest()


def stored_layer_sensitivity(
    path: Path, model_dir: Path, adapter: FamilyAdapter, batches: list[dict[str, torch.Tensor]], mode: str
) -> dict[int, torch.Tensor]:
    """:func:`layer_sensitivity`, kept in ``path`` (a resumable run's state) and taken from there when it was
    computed for the same mode, model and calibration tokens.

    A resumed run then skips the costliest step of the pass (the whole model loaded, one backward pass), and its
    remaining layers are weighed exactly as the killed run's finished ones were."""
    if mode == "none":
        return {}
    key = f"{mode}:{Path(model_dir).absolute()}:{_batches_digest(batches)}"
    try:
        stored, metadata = load_with_metadata(path)
        if metadata.get("key") == key:
            return {int(name): value for name, value in stored.items()}
    except (OSError, SafetensorError):
        pass
    sensitivity = layer_sensitivity(model_dir, adapter, batches, mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomically(path, {str(layer): value for layer, value in sensitivity.items()}, {"key": key})
    return sensitivity
