"""A sequential sweep's second forward of a layer without its attention computed again.

A sequentially calibrated sweep runs each MoE layer twice: once to capture the MoE block's inputs, then again with
the rewritten block in place, for the next layer's inputs. Whatever the layer computes before its MoE block reads
the same inputs and weights both times, so its attention's outputs are the same tensors: :class:`AttentionReplay`
keeps them from the first forward and hands them back in the second, which then computes only the norms, the MoE
block and what follows it.

It replays only where the first forward showed, for every batch, one attention call before the MoE block's (an
attention after the block, or inside it, reads what the block changes), and only outputs that nothing modified in
place since (their float64 sums are compared); anything else is computed again.
"""

from __future__ import annotations

from typing import Any

import torch


def _sum(output: Any) -> float | None:
    """The float64 sum of ``output``'s first tensor (the attention's hidden states), None for no tensor."""
    first = output[0] if isinstance(output, tuple) else output
    if not isinstance(first, torch.Tensor):
        return None
    return float(first.sum(dtype=torch.float64))


class AttentionReplay:
    """Records a layer's attention outputs in the capturing forward (:meth:`watch`), and gives them back in the
    recomputing one (:meth:`replaying`) where that is exact."""

    def __init__(self, attention: torch.nn.Module, moe_site: torch.nn.Module):
        self.attention = attention
        self.nested = any(m is moe_site for m in attention.modules()) or any(m is attention for m in moe_site.modules())
        self.outputs: list[Any] = []
        self.sums: list[float | None] = []
        self.order: list[str] = []
        self._handles = [
            attention.register_forward_hook(self._record_attention),
            moe_site.register_forward_hook(lambda *_: self.order.append("moe")),
        ]

    def _record_attention(self, _module, _args, output) -> None:
        self.order.append("attention")
        self.outputs.append(output)
        self.sums.append(_sum(output))

    def stop_watching(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def replayable(self, batches: int) -> bool:
        """Whether the capturing forward called the attention once before the MoE block, in each of ``batches``."""
        ordered = self.order == ["attention", "moe"] * batches
        return ordered and not self.nested and all(s is not None for s in self.sums)

    def replaying(self) -> _Replaying:
        return _Replaying(self)


class _Replaying:
    """While entered, the attention module returns the recorded outputs in order (computing any that changed)."""

    def __init__(self, replay: AttentionReplay):
        self.replay = replay

    def __enter__(self) -> None:
        replay = self.replay
        original = replay.attention.forward
        calls = iter(zip(replay.outputs, replay.sums, strict=True))

        def forward(*args: Any, **kwargs: Any) -> Any:
            recorded, total = next(calls, (None, None))
            if recorded is not None and _sum(recorded) == total:
                return recorded
            return original(*args, **kwargs)

        replay.attention.forward = forward

    def __exit__(self, *exc: object) -> None:
        replay = self.replay
        del replay.attention.forward
        replay.outputs, replay.sums = [], []
