"""The block-output Fisher (:func:`~.sensitivity.block_output_fisher`) through a looped segment (Inkling 2 Loop):
its layers run once per pass, so the segment is run forward whole from its spilled input and backpropagated whole.

A looped MoE layer's values are those of every pass, in the order its calibration capture holds its inputs: batch
by batch, each batch pass by pass (:meth:`~moecompress.sweep.engine.CalibrationSweep._looped_segment`).
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors.torch import load_file

from ..device import host_buffer, to_compute
from ..sweep.engine import CalibrationSweep
from ..sweep.layer_carry import LayerCarry

_CARRIED = "carried:"


def looped_forward(sweep: CalibrationSweep, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
    """The segment's output after its last pass (the calibration sweep's own passes)."""
    held = {layer: sweep.materialise(layer)[:1] for layer in sweep.adapter.loop_layers}
    try:
        return sweep._loop_passes(held, hidden)
    finally:
        for (module,) in held.values():
            sweep.release(module)


def _segment(
    sweep: CalibrationSweep,
    modules: dict[int, torch.nn.Module],
    carry: LayerCarry,
    batch: int,
    states: torch.Tensor,
    read: dict[int, torch.Tensor],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Batch ``batch``'s segment output from its input ``states`` and the block-stack entries before it (``read``),
    differentiable; with the last pass's block-boundary inputs inside the segment, by layer."""
    adapter, loop = sweep.adapter, sweep.adapter.loop_layers
    inside = [layer for layer in loop[1:] if adapter.is_block_boundary(layer)]
    previous = None
    blocks: dict[int, torch.Tensor] = {}
    for _ in range(adapter.loop_passes):
        blocks, hidden = dict(read), states
        for index, layer in enumerate(loop):
            args, kwargs = sweep.call_arguments(layer, batch)
            args = list(carry.with_outputs(layer, batch, args))
            args[adapter.block_states_argument] = carry.stack([blocks[e] for e in sorted(blocks) if e < layer], hidden)
            args[adapter.message_argument] = None if previous is None else sweep._message_input(*previous, index)
            if adapter.is_block_boundary(layer):
                blocks[layer] = hidden
            out = modules[layer](hidden, *args, **carry.arguments(layer, batch, kwargs))
            hidden = out[0] if isinstance(out, tuple) else out
        previous = (carry.stack([blocks[layer] for layer in inside], hidden), hidden)
    return hidden, {layer: blocks[layer] for layer in loop if layer in blocks}


def backpropagate_loop(
    sweep: CalibrationSweep,
    inputs_path: str,
    output_gradients: list[torch.Tensor],
    squares: dict[int, list[torch.Tensor]],
    block_gradients: list[dict[int, torch.Tensor]],
) -> list[torch.Tensor]:
    """The gradients at the segment's input given those at its output (as
    :func:`~.sensitivity._backpropagate_layer` for one layer): each looped MoE layer's ``‖∂loss/∂(block output)‖² /
    H`` of every pass appended to ``squares``, the gradients at the stack entries before the segment added to
    ``block_gradients``, those the later layers gave the last pass's entries inside it taken from there."""
    adapter, loop = sweep.adapter, sweep.adapter.loop_layers
    modules = {layer: sweep.materialise(layer)[0].requires_grad_(False) for layer in loop}
    sweep._message_input.requires_grad_(False)
    per_pass: dict[int, list[list[torch.Tensor]]] = {layer: [] for layer in loop if layer in squares}
    handles = []
    for layer in per_pass:

        def record(_module: Any, _args: Any, output: Any, layer: int = layer) -> None:
            out = output[0] if isinstance(output, tuple) else output
            slot: list[torch.Tensor] = []
            per_pass[layer].append(slot)
            out.register_hook(lambda grad: slot.append(grad.float().pow(2).mean(dim=-1).reshape(-1).cpu()))

        site = modules[layer].get_submodule(adapter.runtime_in_layer(layer, adapter.moe_site_module))
        handles.append(site.register_forward_hook(record))
    inputs = load_file(inputs_path)
    carry = LayerCarry(adapter, len(output_gradients))
    carry.restore({name[len(_CARRIED) :]: inputs.pop(name) for name in list(inputs) if name.startswith(_CARRIED)})
    input_gradients = []
    try:
        for index, gradient in enumerate(output_gradients):
            states = to_compute(inputs.pop(str(index))).requires_grad_(True)
            entries = carry.block_entries(index, loop.start)
            read = {layer: to_compute(entry).clone().requires_grad_(True) for layer, entry in entries}
            for slots in per_pass.values():
                slots.clear()
            with torch.enable_grad():
                out, inside = _segment(sweep, modules, carry, index, states, read)
            held = block_gradients[index]
            later = [layer for layer in inside if layer != loop.start and layer in held]
            grads = torch.autograd.grad(
                [out, *(inside[layer] for layer in later)],
                [states, *read.values()],
                grad_outputs=[to_compute(gradient), *(to_compute(held.pop(layer)) for layer in later)],
                allow_unused=True,
            )
            input_gradient, read_gradients = grads[0], grads[1:]
            for entry_layer, entry_gradient in zip(read, read_gradients, strict=True):
                if entry_gradient is not None:
                    entry_gradient = host_buffer(entry_gradient)
                    held[entry_layer] = held[entry_layer] + entry_gradient if entry_layer in held else entry_gradient
            if loop.start in held:
                input_gradient = input_gradient + to_compute(held.pop(loop.start))
            input_gradients.append(host_buffer(input_gradient))
            for layer, slots in per_pass.items():
                squares[layer].extend(value for slot in slots for value in slot)
            del out, inside, states, read, grads
    finally:
        for handle in handles:
            handle.remove()
        for module in modules.values():
            sweep.release(module)
    return input_gradients
