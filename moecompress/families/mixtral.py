"""Mixtral: ``block_sparse_moe`` on disk with ``w1`` (gate), ``w3`` (up), ``w2`` (down) per expert."""

from __future__ import annotations

from .base import FamilyAdapter


class MixtralAdapter(FamilyAdapter):
    family = "mixtral"
    model_types = ("mixtral",)
    per_expert_linears = True
    llama_cpp_shared_expert = False
    moe_disk_prefix = "block_sparse_moe."
    expert_names = ("w1", "w3", "w2")
    num_experts_keys = ("num_local_experts", "num_experts")
    head_pruning = True

    def runtime_local_name(self, local_key: str) -> str:
        return local_key.replace("block_sparse_moe.", "mlp.", 1)

    def routing_rule(self):
        from .routing import RoutingRule

        return RoutingRule("softmax_topk", top_k=self.top_k, normalize=True)


class PhimoeAdapter(MixtralAdapter):
    """PhiMoE (Phi-3.5-MoE): Mixtral's on-disk layout; transformers names the router ``mlp.router`` at runtime; routes
    by ``sparsemixer`` (top-2 only); layer norms and attention projections carry biases."""

    family = "phimoe"
    model_types = ("phimoe",)
    router_module = "mlp.router"
    router_key = "gate"
    head_pruning = False

    def routing_rule(self):
        from ..errors import UserInputError
        from .routing import RoutingRule

        if self.top_k != 2:
            raise UserInputError(f"phimoe: sparsemixer routes to 2 experts, config.json asks for {self.top_k}")
        return RoutingRule("sparsemixer", top_k=2, jitter_eps=float(self.text_config.get("router_jitter_noise", 0.0)))
