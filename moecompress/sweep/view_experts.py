"""A decoder layer's routed experts computed straight from the MoE view, one expert at a time.

The layer-by-layer sweeps (calibration, sensitivity, streamed evaluation) build each decoder layer as the stock
transformers module. Loaded as it is, that module would hold a second copy of the experts in the sweep's float32
(2.4 GB for a Qwen3-30B-A3B layer, next to the view's 1.2 GB of bf16), and transformers' ``grouped_mm`` path copies
every token once per chosen expert (1.1 GB for 16 windows of 256 tokens). :class:`ViewExperts` takes the stock
experts module's place instead: it computes from the view's tensors in whatever dtype they are stored, converting
one expert's weights to the input's dtype as it is used (exact for bf16 to float32), and gathers only the tokens
routed to that expert. Its outputs equal the stock module's to float32 rounding (the sum runs in another order).

A sequentially calibrated sweep gives it a rewritten block (pruned, quantised) the same way, through an
:class:`ExpertSource` that dequantises one expert at a time, so the rewritten block is never materialised whole.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..families import FamilyAdapter, MoEWeights


@dataclass
class ExpertSource:
    """Where :class:`ViewExperts` takes an expert's weights from: ``view`` (canonical layout, any float dtype),
    optionally with ``weights_of(position)`` giving a position's ``gate_up [2I, H]`` and ``down [H, I]`` instead
    of ``view``'s (a quantised block dequantised expert by expert), and ``positions`` mapping the router's expert
    index to a position in ``view`` (-1: removed, never chosen)."""

    view: MoEWeights
    weights_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
    positions: list[int] | None = None

    def expert(self, index: int) -> MoEWeights | None:
        """A one-expert view of the router's expert ``index`` (None if it was removed)."""
        position = index if self.positions is None else self.positions[index]
        if position < 0:
            return None
        view = self.view
        gate_up, down = self.weights_of(position) if self.weights_of is not None else (None, None)

        def one(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor[position : position + 1]

        return replace(
            view,
            gate_up=one(view.gate_up) if gate_up is None else gate_up.unsqueeze(0),
            down=one(view.down) if down is None else down.unsqueeze(0),
            gate_up_bias=one(view.gate_up_bias),
            down_bias=one(view.down_bias),
            expert_norm=one(view.expert_norm),
        )

    @property
    def num_experts(self) -> int:
        return self.view.num_experts if self.positions is None else len(self.positions)

    def padded(self, like: MoEWeights) -> MoEWeights:
        """The source as a whole block of ``like``'s size (removed experts zero), for an experts module that
        cannot compute from a source."""
        gate_up = torch.zeros(like.gate_up.shape, dtype=like.gate_up.dtype, device=like.gate_up.device)
        down = torch.zeros(like.down.shape, dtype=like.down.dtype, device=like.down.device)
        gate_up_bias = None if like.gate_up_bias is None else torch.zeros_like(like.gate_up_bias)
        down_bias = None if like.down_bias is None else torch.zeros_like(like.down_bias)
        expert_norm = None if like.expert_norm is None else torch.zeros_like(like.expert_norm)
        for index in range(like.num_experts):
            expert = self.expert(index)
            if expert is None:
                continue
            gate_up[index] = expert.gate_up[0]
            down[index] = expert.down[0]
            if gate_up_bias is not None:
                gate_up_bias[index] = expert.gate_up_bias[0]
                down_bias[index] = expert.down_bias[0]
            if expert_norm is not None:
                expert_norm[index] = expert.expert_norm[0]
        return replace(
            like, gate_up=gate_up, down=down, gate_up_bias=gate_up_bias, down_bias=down_bias, expert_norm=expert_norm
        )

    def to(self, device: torch.device) -> ExpertSource:
        from ..device import moe_on

        return replace(self, view=moe_on(self.view, device))


class ViewExperts(nn.Module):
    """A drop-in for a transformers 5 fused experts module called as ``experts(hidden [T, H], ids [T, k],
    weights [T, k])``, computing from an :class:`ExpertSource` (set per layer, cleared by :meth:`release`)."""

    def __init__(self, adapter: FamilyAdapter):
        super().__init__()
        self.adapter = adapter
        self.source: ExpertSource | None = None
        self.outputs_unused = False
        """Set by a sweep whose layer outputs of this forward nobody reads (only the block's inputs are captured):
        the experts are not computed and contribute zeros."""

    def release(self) -> None:
        self.source = None
        self.outputs_unused = False

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.outputs_unused:
            return torch.zeros_like(hidden_states)
        source = self.source
        if source is None:
            raise RuntimeError("ViewExperts called without weights")
        grad = torch.is_grad_enabled()

        def output_of(index: int, x: torch.Tensor) -> torch.Tensor | None:
            expert = source.expert(index) if 0 <= index < source.num_experts else None
            if expert is None:
                return None
            if grad and x.requires_grad:
                # Autograd would keep every expert's converted weights for the backward (2.4 GB a Qwen3-30B-A3B
                # layer); recomputing the expert there keeps only its inputs.
                return checkpoint(self.adapter.expert_output, expert, 0, x, use_reentrant=False)
            return self.adapter.expert_output(expert, 0, x)

        return self.adapter.combine_experts(hidden_states, top_k_index, top_k_weights, output_of)


def takes_routed_tokens(experts: nn.Module) -> bool:
    """Whether ``experts`` is called as ``experts(hidden, ids, weights)`` (every family but those that run every
    expert on every token, as Llama 4 does), so that :class:`ViewExperts` can stand in for it."""
    if isinstance(experts, ViewExperts):
        return True
    try:
        parameters = inspect.signature(experts.forward).parameters
    except (TypeError, ValueError):
        return False
    return len(parameters) == 3 and isinstance(getattr(experts, "down_proj", None), torch.Tensor)


def install(block: nn.Module, adapter: FamilyAdapter) -> ViewExperts | None:
    """Put a :class:`ViewExperts` in ``block``'s ``experts`` place (once; later calls find it there); None where
    the family's experts cannot be replaced."""
    experts = getattr(block, "experts", None)
    if experts is None or not takes_routed_tokens(experts):
        return None
    if not isinstance(experts, ViewExperts):
        experts = ViewExperts(adapter)
        block.experts = experts
    return experts


def release_all(module: nn.Module) -> None:
    for child in module.modules():
        if isinstance(child, ViewExperts):
            child.release()
