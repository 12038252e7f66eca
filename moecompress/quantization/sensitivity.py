"""How much an error at each MoE block's output costs downstream: the empirical Fisher of the calibration loss with
respect to the block output.

An error ``δ_t`` added to block ``l``'s output at token ``t`` raises the loss by about ``½ δ_tᵀ F_l δ_t``, with
``F_l = E[g gᵀ]`` and ``g = ∂loss/∂y_l``. The low-rank allocation measures ``‖δ‖²`` only, so the isotropic part
of ``F_l``, ``s_l = E_t ‖g_t‖² / H``, is the factor that makes the gains of different layers comparable: it sees
that an early layer's error passes through every later layer before it reaches the loss.

The gradient pass streams the decoder one layer at a time, forward then backward (:func:`block_output_fisher`).
Where later layers read a stack of earlier layers' inputs (Inkling 2's ``block_states``), the gradient at each stack
entry is gathered from every layer (and the head) that reads it and added to the gradient at its layer's input.
An encoder-decoder's loss is its decoder's next-token loss on the decoder inputs (every target but the last); the
gradient at the encoder's output is gathered from every decoder layer's cross-attention input and taken through the
encoder's final norm to its last layer's output (the decoder's first layer's input gradient, its embeddings', is
not the encoder's). A
looped segment (Inkling 2 Loop) is run and backpropagated whole, every pass (:mod:`.looped_fisher`).
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
from ..progress import bar as progress_bar
from ..sweep.engine import CalibrationSweep, split_windows
from ..sweep.layer_carry import LayerCarry
from ..sweep.state import load_with_metadata
from .looped_fisher import backpropagate_loop, looped_forward

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
            loop = adapter.loop_layers if adapter.loop_passes > 1 else range(0)
            for layer in progress_bar(layers, desc="sensitivity (forward)", unit="layer", disable=not progress):
                if layer in loop[1:]:
                    continue
                if layer >= lowest or (loop and layer == loop.start):
                    carried = {f"{_CARRIED}{name}": value for name, value in sweep.carry.tensors().items()}
                    inputs = {str(i): h for i, h in enumerate(hidden)}
                    write_safetensors(f"{spill}/{layer}.safetensors", {**inputs, **carried}, {})
                if layer in loop:
                    hidden = looped_forward(sweep, hidden)
                    continue
                module, moe = sweep.materialise(layer)
                del moe
                sweep.reader.advise(sweep.layer_keys.get(layer + 1, []))
                outputs = sweep.forward_layer(module, layer, hidden)
                sweep.release(module)
                hidden = sweep.injected(layer, outputs)
                del outputs
                if layer + 1 in adapter.stack_starts():
                    write_safetensors(_stack_output(spill, layer), {str(i): h for i, h in enumerate(hidden)}, {})
                    hidden = sweep.next_stack(layer, hidden)
            gradients, block_gradients = _head_gradients(sweep, batches, hidden)
            del hidden
            encoder_gradients: list[torch.Tensor | None] = [None] * len(batches)
            squares: dict[int, list[torch.Tensor]] = {layer: [] for layer in moe_layers}
            below = progress_bar(
                reversed(range(lowest, adapter.num_layers)),
                desc="sensitivity (backward)",
                unit="layer",
                total=adapter.num_layers - lowest,
                disable=not progress,
            )
            for layer in below:
                if layer in loop:
                    if layer == loop[-1]:
                        path = f"{spill}/{loop.start}.safetensors"
                        gradients = backpropagate_loop(sweep, path, gradients, squares, block_gradients)
                        Path(path).unlink()
                    continue
                gradients = _backpropagate_layer(
                    sweep, layer, f"{spill}/{layer}.safetensors", gradients, squares, block_gradients, encoder_gradients
                )
                Path(f"{spill}/{layer}.safetensors").unlink()
                if layer > lowest and layer in adapter.stack_starts():
                    gradients = _through_encoder_norm(sweep, _stack_output(spill, layer - 1), encoder_gradients)
    finally:
        sweep.reader.close()
    return {layer: torch.cat(values) for layer, values in squares.items()}


def _stack_output(spill: str, layer: int) -> str:
    """Where the forward keeps the outputs of layer ``layer``, the last of a stack (an encoder's, before its norm)."""
    return f"{spill}/stack-{layer}.safetensors"


def _through_encoder_norm(
    sweep: CalibrationSweep, outputs_path: str, encoder_gradients: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    """Per batch, the gradient at the encoder's last layer output, from the gradient at its normalised output that
    the decoder layers gathered."""
    outputs = load_file(outputs_path)
    gradients = []
    with torch.enable_grad():
        for index, gradient in enumerate(encoder_gradients):
            states = outputs.pop(str(index)).requires_grad_(True)
            if gradient is None:
                gradients.append(torch.zeros_like(states))
                continue
            normed = sweep.encoder_norm(states)
            (input_gradient,) = torch.autograd.grad(normed, [states], grad_outputs=gradient.to(normed.dtype))
            gradients.append(input_gradient)
    Path(outputs_path).unlink()
    return gradients


def _loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`next_token_loss` of a batch: on its decoder's inputs where it has them (an encoder-decoder)."""
    targets = batch["decoder_input_ids"] if "decoder_input_ids" in batch else batch["input_ids"]
    return next_token_loss(logits, targets.to(logits.device))


def _head_gradients(
    sweep: CalibrationSweep, batches: list[dict[str, torch.Tensor]], hidden: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[dict[int, torch.Tensor]]]:
    """Per batch, ``∂loss/∂(last hidden states)``, and the gradient at each block-stack entry the head reads, by
    its layer (none where the family has no stack). Text-only batches go through the head a few windows at a time
    and without the input embeddings (:meth:`~moecompress.sweep.engine.CalibrationSweep.text_head_logits`): at
    Qwen3-30B-A3B's 151,936-token vocabulary a batch of 8 windows of 256 has 1.2 GB of float32 logits, and the
    loss's backward as much again. The summed loss is a sum over windows, so each window's gradient is the same
    whichever windows share its head call."""
    stacks = sweep.final_block_states(hidden)
    head_batches, head_hidden, head_stacks, logits_of, windows = batches, hidden, stacks, sweep.head_logits, 0
    if batches and all(set(batch) == {"input_ids"} for batch in batches):
        seq_len, vocab = batches[0]["input_ids"].shape[1], int(sweep.adapter.text_config["vocab_size"])
        windows = windows_per_forward(seq_len, vocab)
        head_batches, head_hidden = split_windows(batches, hidden, windows)
        head_stacks = None if stacks is None else split_windows(batches, stacks, windows)[1]
        logits_of = sweep.text_head_logits
    leaves = [to_compute(h).clone().requires_grad_(True) for h in head_hidden]
    stack_leaves = None if head_stacks is None else [to_compute(s).clone().requires_grad_(True) for s in head_stacks]
    del head_hidden, head_stacks, stacks
    pieces, stack_pieces = [], []
    for index, logits in enumerate(logits_of(head_batches, leaves, stack_leaves)):
        loss = _loss(logits, head_batches[index])
        wrt = [leaves[index]] if stack_leaves is None else [leaves[index], stack_leaves[index]]
        gradients = torch.autograd.grad(loss, wrt)
        pieces.append(host_buffer(gradients[0]))
        if stack_leaves is not None:
            stack_pieces.append(host_buffer(gradients[1]))
        del logits, loss, gradients
    del leaves, stack_leaves
    gradients, stack_gradients = _joined(batches, pieces, windows), _joined(batches, stack_pieces, windows)
    block_gradients: list[dict[int, torch.Tensor]] = [{} for _ in batches]
    for index, stack in enumerate(stack_gradients):
        layers = [layer for layer, _ in sweep.carry.block_entries(index)]
        block_gradients[index] = {layer: stack[..., j, :] for j, layer in enumerate(layers)}
    return gradients, block_gradients


def _joined(batches: list[dict[str, torch.Tensor]], pieces: list[torch.Tensor], windows: int) -> list[torch.Tensor]:
    """Per batch, the pieces of a head call cut ``windows`` windows at a time (none: one piece a batch) joined."""
    if not windows or not pieces:
        return pieces
    joined, start = [], 0
    for batch in batches:
        count = -(-batch["input_ids"].shape[0] // windows)
        joined.append(torch.cat(pieces[start : start + count]) if count > 1 else pieces[start])
        start += count
    return joined


def _backpropagate_layer(
    sweep: CalibrationSweep,
    layer: int,
    inputs_path: str,
    output_gradients: list[torch.Tensor],
    squares: dict[int, list[torch.Tensor]],
    block_gradients: list[dict[int, torch.Tensor]],
    encoder_gradients: list[torch.Tensor | None],
) -> list[torch.Tensor]:
    """The gradients at layer ``layer``'s inputs, given those at its outputs; appends, for an MoE layer, each
    token's ``‖∂loss/∂(block output)‖² / H`` to ``squares[layer]``. The gradients at the block-stack entries the
    layer reads are added to ``block_gradients`` (per batch, by entry layer); a block-boundary layer's input takes
    its entry's, which every later reader has added by then. A decoder layer's gradient at the encoder output it
    reads is added to ``encoder_gradients`` (per batch)."""
    module, moe = sweep.materialise(layer)
    del moe
    sweep.reader.advise(sweep.layer_keys.get(layer - 1, []))
    module.requires_grad_(False)
    handle = None
    if layer in squares:

        def record(_module, _args, output):
            out = output[0] if isinstance(output, tuple) else output
            out.register_hook(lambda grad: squares[layer].append(grad.float().pow(2).mean(dim=-1).reshape(-1).cpu()))

        site = sweep.adapter.runtime_in_layer(layer, sweep.adapter.moe_site_module)
        handle = module.get_submodule(site).register_forward_hook(record)
    inputs = load_file(inputs_path)
    carry = LayerCarry(sweep.adapter, len(output_gradients))
    carry.restore({name[len(_CARRIED) :]: inputs.pop(name) for name in list(inputs) if name.startswith(_CARRIED)})
    input_gradients = []
    try:
        for index, gradient in enumerate(output_gradients):
            states = to_compute(inputs.pop(str(index))).requires_grad_(True)
            args, kwargs = sweep.call_arguments(layer, index)
            args = carry.with_outputs(layer, index, args)
            entries = carry.block_entries(index, layer) if carry.block_argument is not None else []
            read = [to_compute(entry).clone().requires_grad_(True) for _, entry in entries]
            if carry.block_argument is not None:
                args = list(args)
                args[carry.block_argument] = carry.stack(read, states)
            encoder = carry.encoder[index] if carry.encoder_argument is not None else None
            if encoder is not None:
                encoder = to_compute(encoder).to(states.dtype).requires_grad_(True)
                args = list(args)
                args[carry.encoder_argument] = encoder
            out = module(states, *args, **carry.arguments(layer, index, kwargs))
            out = out[0] if isinstance(out, tuple) else out
            input_gradient, *read_gradients = torch.autograd.grad(
                out, [states, *read, *([] if encoder is None else [encoder])], grad_outputs=to_compute(gradient),
                allow_unused=True,
            )  # fmt: skip
            if encoder is not None:
                encoder_gradient = read_gradients.pop()
                if encoder_gradient is not None:
                    held_encoder = encoder_gradients[index]
                    encoder_gradient = host_buffer(encoder_gradient)
                    encoder_gradients[index] = (
                        encoder_gradient if held_encoder is None else held_encoder + encoder_gradient
                    )
            held = block_gradients[index]
            for (entry_layer, _), entry_gradient in zip(entries, read_gradients, strict=True):
                if entry_gradient is not None:
                    entry_gradient = host_buffer(entry_gradient)
                    held[entry_layer] = held[entry_layer] + entry_gradient if entry_layer in held else entry_gradient
            if carry.block_argument is not None and layer in held:
                input_gradient = input_gradient + to_compute(held.pop(layer))
            input_gradients.append(host_buffer(input_gradient))
            del out, states, read
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
