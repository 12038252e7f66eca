"""How much an error at each MoE block's output costs downstream: the empirical Fisher of the calibration loss with
respect to the block output.

An error ``δ_t`` added to block ``l``'s output at token ``t`` raises the loss by about ``½ δ_tᵀ F_l δ_t``, with
``F_l = E[g gᵀ]`` and ``g = ∂loss/∂y_l``. The low-rank allocation measures ``‖δ‖²`` only, so the isotropic part
of ``F_l``, ``s_l = E_t ‖g_t‖² / H``, is the factor that makes the gains of different layers comparable: it sees
that an early layer's error passes through every later layer before it reaches the loss.

The gradient pass streams the decoder one layer at a time, forward then backward (:func:`block_output_fisher`).
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..device import host_buffer, to_compute
from ..evals.perplexity import windows_per_forward
from ..files import write_safetensors
from ..layer_carry import LayerCarry
from ..progress import bar as progress_bar
from ..sweep import CalibrationSweep, split_windows
from ..sweep_state import load_with_metadata

SENSITIVITIES: tuple[str, ...] = ("none", "fisher", "fisher-token")
_CARRIED = "carried:"
"""Spilled beside a layer's input hidden states: the state earlier layers hand it (:class:`LayerCarry`)."""


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The summed next-token negative log-likelihood, so that each token's gradient does not shrink with the
    batch size."""
    logits = logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="sum")


def block_output_fisher(
    model_dir: Path,
    batches: list[dict[str, torch.Tensor]],
    spill_dir: Path | None = None,
    progress: bool = True,
) -> dict[int, torch.Tensor]:
    """``‖∂loss/∂y_{l,t}‖² / H`` for every MoE layer ``l`` and calibration token ``t`` (in the order of the
    concatenated batches, as the calibration sweep captures them), under :func:`next_token_loss`.

    Backpropagation one decoder layer at a time, so that the model is never whole in memory: a forward sweep
    writes each layer's input hidden states to ``spill_dir`` (a temporary directory inside it; the system's
    temporary directory without one), the loss gives the gradient at the last layer's output, and from the top
    down each layer is read again, run forward from its stored inputs and backpropagated, its MoE block's output
    gradient recorded and its input gradient handed to the layer below. Peak memory is a calibration sweep's
    plus one layer's hidden states and gradients; each layer is read twice.
    """
    tokens = sum(batch["input_ids"].numel() for batch in batches)
    tags = torch.zeros(tokens, dtype=torch.long, device="cpu")
    sweep = CalibrationSweep(model_dir, batches, tags, ["text"], progress=False)
    adapter = sweep.adapter
    moe_layers = adapter.moe_layers()
    if not moe_layers:
        return {}
    lowest = min(moe_layers)
    layers = range(adapter.num_layers)
    if spill_dir is not None:
        Path(spill_dir).mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="fisher-inputs-", dir=spill_dir) as spill:
            hidden = [plan.hidden for plan in sweep.plans]
            for layer in progress_bar(layers, desc="sensitivity (forward)", unit="layer", disable=not progress):
                if layer >= lowest:
                    carried = {f"{_CARRIED}{name}": value for name, value in sweep.carry.tensors().items()}
                    inputs = {str(i): h for i, h in enumerate(hidden)}
                    write_safetensors(f"{spill}/{layer}.safetensors", {**inputs, **carried}, {})
                module, moe = sweep.materialise(layer)
                del moe
                outputs = sweep.forward_layer(module, layer, hidden)
                sweep.release(module)
                hidden = [
                    out + plan.injections[layer] if layer in plan.injections else out
                    for out, plan in zip(outputs, sweep.plans, strict=True)
                ]
                del outputs
            gradients = _head_gradients(sweep, batches, hidden)
            del hidden
            squares: dict[int, list[torch.Tensor]] = {layer: [] for layer in moe_layers}
            below = progress_bar(
                reversed(range(lowest, adapter.num_layers)),
                desc="sensitivity (backward)",
                unit="layer",
                total=adapter.num_layers - lowest,
                disable=not progress,
            )
            for layer in below:
                gradients = _backpropagate_layer(sweep, layer, f"{spill}/{layer}.safetensors", gradients, squares)
                Path(f"{spill}/{layer}.safetensors").unlink()
    finally:
        sweep.reader.close()
    return {layer: torch.cat(values) for layer, values in squares.items()}


def _head_gradients(
    sweep: CalibrationSweep, batches: list[dict[str, torch.Tensor]], hidden: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Per batch, ``∂loss/∂(last hidden states)``. Text-only batches go through the head a few windows at a time
    and without the input embeddings (:meth:`~moecompress.sweep.CalibrationSweep.text_head_logits`): at
    Qwen3-30B-A3B's 151,936-token vocabulary a batch of 8 windows of 256 has 1.2 GB of float32 logits, and the
    loss's backward as much again. The summed loss is a sum over windows, so each window's gradient is the same
    whichever windows share its head call."""
    head_batches, head_hidden, logits_of, windows = batches, hidden, sweep.head_logits, 0
    if batches and all(set(batch) == {"input_ids"} for batch in batches):
        seq_len, vocab = batches[0]["input_ids"].shape[1], int(sweep.adapter.text_config["vocab_size"])
        windows = windows_per_forward(seq_len, vocab)
        head_batches, head_hidden = split_windows(batches, hidden, windows)
        logits_of = sweep.text_head_logits
    leaves = [to_compute(h).clone().requires_grad_(True) for h in head_hidden]
    del head_hidden
    pieces = []
    for leaf, batch, logits in zip(leaves, head_batches, logits_of(head_batches, leaves), strict=True):
        loss = next_token_loss(logits, batch["input_ids"].to(logits.device))
        (gradient,) = torch.autograd.grad(loss, leaf)
        pieces.append(host_buffer(gradient))
        del logits, loss
    del leaves
    if not windows:
        return pieces
    gradients, start = [], 0
    for batch in batches:
        count = -(-batch["input_ids"].shape[0] // windows)
        gradients.append(torch.cat(pieces[start : start + count]) if count > 1 else pieces[start])
        start += count
    return gradients


def _backpropagate_layer(
    sweep: CalibrationSweep,
    layer: int,
    inputs_path: str,
    output_gradients: list[torch.Tensor],
    squares: dict[int, list[torch.Tensor]],
) -> list[torch.Tensor]:
    """The gradients at layer ``layer``'s inputs, given those at its outputs; appends, for an MoE layer, each
    token's ``‖∂loss/∂(block output)‖² / H`` to ``squares[layer]``."""
    module, moe = sweep.materialise(layer)
    del moe
    module.requires_grad_(False)
    handle = None
    if layer in squares:

        def record(_module, _args, output):
            out = output[0] if isinstance(output, tuple) else output
            out.register_hook(lambda grad: squares[layer].append(grad.float().pow(2).mean(dim=-1).reshape(-1).cpu()))

        handle = module.get_submodule(sweep.adapter.moe_site_module).register_forward_hook(record)
    inputs = load_file(inputs_path)
    carry = LayerCarry(sweep.adapter, len(output_gradients))
    carry.restore({name[len(_CARRIED) :]: inputs.pop(name) for name in list(inputs) if name.startswith(_CARRIED)})
    input_gradients = []
    try:
        for index, gradient in enumerate(output_gradients):
            states = to_compute(inputs.pop(str(index))).requires_grad_(True)
            args, kwargs = sweep.call_arguments(layer, index)
            out = module(states, *args, **carry.arguments(layer, index, kwargs))
            out = out[0] if isinstance(out, tuple) else out
            (input_gradient,) = torch.autograd.grad(out, states, grad_outputs=to_compute(gradient))
            input_gradients.append(host_buffer(input_gradient))
            del out, states
    finally:
        if handle is not None:
            handle.remove()
        sweep.release(module)
    return input_gradients


def layer_sensitivity(
    model_dir: Path,
    batches: list[dict[str, torch.Tensor]],
    mode: str,
    spill_dir: Path | None = None,
    progress: bool = True,
) -> dict[int, torch.Tensor]:
    """Per MoE layer, the factor on its error: nothing for ``none``; for ``fisher`` its mean Fisher (a scalar
    tensor), for ``fisher-token`` every token's. Both are divided by the mean over all layers and tokens, as only
    ratios matter to the allocation."""
    if mode not in SENSITIVITIES:
        raise ValueError(f"unknown sensitivity {mode!r}; choose from {SENSITIVITIES}")
    if mode == "none":
        return {}
    fisher = block_output_fisher(model_dir, batches, spill_dir, progress)
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
    path: Path, model_dir: Path, batches: list[dict[str, torch.Tensor]], mode: str, progress: bool = True
) -> dict[int, torch.Tensor]:
    """:func:`layer_sensitivity`, kept in ``path`` (a resumable run's state) and taken from there when it was
    computed for the same mode, model and calibration tokens.

    A resumed run then skips the costliest step of the pass (the whole model loaded, one backward pass), and its
    remaining layers are weighed exactly as the killed run's finished ones were."""
    if mode == "none":
        return {}
    key = f"{mode}:{Path(model_dir).absolute()}:{_batches_digest(batches)}"
    return stored_per_layer(
        path, key, lambda: layer_sensitivity(model_dir, batches, mode, spill_dir=path.parent, progress=progress)
    )


def stored_per_layer(path: Path, key: str, compute) -> dict[int, torch.Tensor]:
    """Per-layer tensors kept in ``path`` under ``key``: read back when the file holds that key, else ``compute()``d
    and written there."""
    try:
        stored, metadata = load_with_metadata(path)
        if metadata.get("key") == key:
            return {int(name): value for name, value in stored.items()}
    except (OSError, SafetensorError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    values = compute()
    write_safetensors(path, {str(layer): value for layer, value in values.items()}, {"key": key})
    return values
