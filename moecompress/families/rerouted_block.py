"""MoE blocks whose stock forward computes more from the router's choice than the routed-experts module does
(Inkling's shared experts, routed as router columns past the FFN experts; LongCat-Flash's identity experts, which the
block adds itself): their stock routed output is the whole block's, run with the router's choice replaced."""

from __future__ import annotations

import torch


class StockBlockRerouted:
    """Mixin, listed before the family's adapter class."""

    def stock_experts(
        self, model: torch.nn.Module, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The stock MoE block with its router's choice replaced by ``ids`` and ``weights`` in the view's form
        (:meth:`with_route`)."""
        block = self.moe_block_of(model, layer)
        router = self.router_of(model, layer)
        handle = router.register_forward_hook(lambda module, args, output: self.with_route(output, weights, ids))
        try:
            return block(hidden)
        finally:
            handle.remove()
