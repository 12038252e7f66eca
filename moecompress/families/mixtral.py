"""Mixtral: ``block_sparse_moe`` on disk with ``w1`` (gate), ``w3`` (up), ``w2`` (down) per expert."""

from __future__ import annotations

from .base import FamilyAdapter


class MixtralAdapter(FamilyAdapter):
    family = "mixtral"
    model_types = ("mixtral",)
    moe_disk_prefix = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")
    num_experts_keys = ("num_local_experts", "num_experts")
    head_pruning = True

    def runtime_local_name(self, local_key: str) -> str:
        return local_key.replace("block_sparse_moe.", "mlp.", 1)

    def routing_rule(self):
        from .routing import RoutingRule

        return RoutingRule("softmax_topk", top_k=self.top_k, normalize=True)
