"""Capture the top-k experts every MoE layer chooses, in the original model's expert ids."""

from __future__ import annotations

import torch

from ..families import FamilyAdapter


class RouteRecorder:
    """Forward hooks on every router; after a forward, ``routes[layer]`` is ``[T, k]`` original expert ids.

    The adapter reads each router's output as ``(logits, weights, top-k ids)``; ids are positions in the
    (possibly pruned) layer and are mapped back through the checkpoint's kept-expert table (identity experts to
    negative ids). A looped layer's (:attr:`~moecompress.families.FamilyAdapter.loop_layers`) routes of every pass
    are kept, one pass after the other.
    """

    def __init__(self, model: torch.nn.Module, adapter: FamilyAdapter):
        self.routes: dict[int, torch.Tensor] = {}
        self._handles = []
        looped = adapter.loop_layers if adapter.loop_passes > 1 else range(0)
        for layer in adapter.moe_layers():
            id_map = torch.tensor(adapter.route_ids(layer), dtype=torch.long, device="cpu")
            router = adapter.router_of(model, layer)
            self._handles.append(router.register_forward_hook(self._hook(adapter, layer, id_map, layer in looped)))

    def _hook(self, adapter: FamilyAdapter, layer: int, id_map: torch.Tensor, looped: bool):
        def record(module, inputs, output):
            ids = adapter.route_of(output)[2]
            ids = id_map[ids.reshape(-1, ids.shape[-1]).cpu()]
            if looped and layer in self.routes:
                ids = torch.cat([self.routes[layer], ids])
            self.routes[layer] = ids

        return record

    def clear(self) -> None:
        self.routes = {}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def routing_agreement(reference: dict[int, torch.Tensor], routes: dict[int, torch.Tensor]) -> tuple[float, int]:
    """Sum over layers and tokens of |S_ref ∩ S| / k_ref, and the number of (layer, token) pairs summed."""
    total, count = 0.0, 0
    for layer, ref_ids in reference.items():
        if layer not in routes:
            continue
        ids = routes[layer]
        overlap = (ref_ids[:, :, None] == ids[:, None, :]).any(dim=-1).sum(dim=-1).float()
        total += (overlap / ref_ids.shape[1]).sum().item()
        count += ref_ids.shape[0]
    return total, count
