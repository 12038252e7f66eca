"""Routing rules: how a family turns router logits into top-k expert ids and mixing weights.

Each rule reproduces the transformers 5 router of its family exactly (same float32 arithmetic, same
tie-breaking through ``torch.topk``). ``allowed`` masks experts out of the choice, which is how a removed
expert's tokens are redistributed: the next best allowed expert enters the top-k and the weights are
renormalised the way the family renormalises. Softmax rules mask the logits, so the result equals routing in
a model whose router row for that expert was deleted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

RuleKind = Literal[
    "softmax_topk",
    "topk_softmax",
    "topk_sigmoid",
    "sigmoid_group_topk",
    "softmax_group_topk",
    "softmax_bias_topk",
    "bias_topk_sigmoid",
    "sparsemixer",
    "sigmoid_shared_topk",
]

_MASK_LOGITS = ("softmax_topk", "topk_sigmoid", "softmax_group_topk", "softmax_bias_topk", "sparsemixer")
"""Rules whose removed experts are masked out of the logits (equal to deleting their router rows)."""


@dataclass(frozen=True)
class RoutingRule:
    """A family's routing rule with the config values it depends on.

    - ``softmax_topk``: softmax over all experts, top-k, renormalise the k weights if ``normalize``
      (Mixtral, Qwen2/3-MoE, OLMoE, Qwen3-VL-MoE).
    - ``topk_softmax``: top-k of the logits, softmax over those k (GPT-OSS).
    - ``topk_sigmoid``: top-k of the logits, each weighted by the sigmoid of its own logit (Llama 4).
    - ``sigmoid_group_topk``: sigmoid scores, choice on scores plus a correction bias restricted to the best
      ``topk_group`` of ``n_group`` groups (a group's score is the sum of its two best), weights are the
      uncorrected scores, renormalised if ``normalize`` (DeepSeek-V3).
    - ``softmax_group_topk``: softmax scores, optionally restricted to the best groups by their maximum
      (DeepSeek-V2 ``group_limited_greedy``), weights not renormalised.
    - ``softmax_bias_topk``: softmax scores, choice on scores plus a correction bias, weights are the uncorrected
      scores, if ``normalize`` divided by their sum clamped below at ``norm_min`` (ERNIE 4.5; LongCat-Flash does
      not renormalise).
    - ``bias_topk_sigmoid``: choice on the logits plus a correction bias, each chosen expert weighted by the sigmoid
      of its own logit, renormalised if ``normalize`` (Kolibri).
    - ``sparsemixer``: PhiMoE's top-2 at inference. The best expert, weighted by its softmax over the logits within
      a relative distance ``2 * jitter_eps`` of its own; then the best of the others, weighted the same way among
      the others.
    - ``sigmoid_shared_topk``: the last ``shared`` logits are shared experts' (Inkling). Choice on the sigmoid of the
      other logits plus a correction bias; the k chosen and the ``shared`` shared experts (always chosen, their ids
      after the routed ones) are weighted together, each by the sigmoid of its logit divided by the sum over them all.
    Every rule multiplies the weights by ``scaling``.

    With ``scales_input`` the weights multiply each chosen expert's *input* token, not its output (Llama 4's block
    runs ``expert(w * x)``); for a nonlinear expert that is another function. Consumers read what an expert sees
    and what its output is multiplied by from :meth:`expert_input` and :meth:`output_weight`. Only rules whose
    weight of an expert depends on the token and that expert alone (``topk_sigmoid``) may scale inputs, so an
    expert's contribution to a token stays the same whichever other experts are chosen with it.
    """

    kind: RuleKind
    top_k: int
    normalize: bool = True
    scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_min: float = 0.0
    jitter_eps: float = 0.0
    norm_eps: float = 1e-20
    """What ``sigmoid_group_topk`` adds to the sum it divides by (LFM2-MoE: 1e-6)."""
    scales_input: bool = False
    score: Literal["sigmoid", "sqrtsoftplus"] = "sigmoid"
    """``sigmoid_group_topk``'s score of a logit: the sigmoid, or DeepSeek-V4's ``sqrt(softplus(x))``."""
    shared: int = 0
    """``sigmoid_shared_topk``'s shared experts: the router's last columns, chosen for every token."""
    norm_p: float | None = None
    """``softmax_topk`` with ``normalize``: the chosen weights are divided by their ``p``-norm (DBRX's
    ``moe_normalize_expert_weights``, as ``torch.norm`` computes it) instead of their sum."""

    def __post_init__(self) -> None:
        if self.scales_input and self.kind != "topk_sigmoid":
            raise ValueError(f"rule {self.kind!r} weighs an expert by more than its own logit: it cannot scale inputs")

    def expert_input(self, hidden: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """What an expert computes on for tokens ``hidden`` ``[T, H]`` routed to it with weights ``weight``
        ``[T, 1]``."""
        return hidden * weight.to(hidden.dtype) if self.scales_input else hidden

    def output_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """What multiplies an expert's output for tokens routed to it with weights ``weight``."""
        return torch.ones_like(weight) if self.scales_input else weight

    def route(
        self,
        logits: torch.Tensor,
        correction_bias: torch.Tensor | None = None,
        allowed: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids ``[T, k]`` and their weights ``[T, k]`` (float32) for router logits ``[T, E]``.

        ``allowed`` is a boolean ``[E]`` or ``[T, E]`` mask; disallowed experts are never chosen.
        """
        logits = logits.float()
        if allowed is not None and self.kind in _MASK_LOGITS:
            logits = logits.masked_fill(~allowed, float("-inf"))
        if self.kind == "softmax_topk":
            probs = torch.softmax(logits, dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.normalize:
                weights = weights / self._norm(weights)
        elif self.kind == "topk_softmax":
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
            top_logits, ids = torch.topk(logits, self.top_k, dim=-1)
            weights = torch.softmax(top_logits, dim=-1)
        elif self.kind == "topk_sigmoid":
            top_logits, ids = torch.topk(logits, self.top_k, dim=-1)
            weights = top_logits.sigmoid()
        elif self.kind == "sigmoid_group_topk":
            scores = self._scores(logits)
            choice = scores if correction_bias is None else scores + correction_bias.float()
            if allowed is not None:
                choice = choice.masked_fill(~allowed, float("-inf"))
            choice = self._restrict_to_groups(choice, group_size_reduce="top2", fill=float("-inf"))
            ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if self.normalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + self.norm_eps)
        elif self.kind == "softmax_group_topk":
            scores = torch.softmax(logits, dim=-1)
            if self.n_group > 1:
                scores = self._restrict_to_groups(scores, group_size_reduce="max", fill=0.0)
            weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
            if self.normalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        elif self.kind == "softmax_bias_topk":
            scores = torch.softmax(logits, dim=-1)
            choice = scores if correction_bias is None else scores + correction_bias.float()
            if allowed is not None:
                choice = choice.masked_fill(~allowed, float("-inf"))
            ids = torch.topk(choice, self.top_k, dim=-1)[1]
            weights = self._clamped_normalised(scores.gather(1, ids))
        elif self.kind == "bias_topk_sigmoid":
            choice = logits if correction_bias is None else logits + correction_bias.float()
            if allowed is not None:
                choice = choice.masked_fill(~allowed, float("-inf"))
            ids = torch.topk(choice, self.top_k, dim=-1)[1]
            weights = self._sigmoid_of_chosen(logits, ids)
        elif self.kind == "sparsemixer":
            first = logits.argmax(dim=-1, keepdim=True)
            second = logits.scatter(1, first, float("-inf")).argmax(dim=-1, keepdim=True)
            ids = torch.cat([first, second], dim=1)
            weights = self._sparsemixer_weights(logits, ids)
        elif self.kind == "sigmoid_shared_topk":
            routed = logits.shape[-1] - self.shared
            choice = logits[:, :routed].sigmoid()
            choice = choice if correction_bias is None else choice + correction_bias.float()[:routed]
            if allowed is not None:
                choice = choice.masked_fill(~allowed[..., :routed], float("-inf"))
            ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
            ids = self._with_shared(ids, routed)
            weights = self._shared_normalised(logits, ids)
        else:
            raise ValueError(f"unknown routing rule {self.kind!r}")
        return ids, weights * self.scaling

    def weights_for(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weights this rule gives the experts ``ids`` ``[T, k]`` when they are the chosen ones, from router
        logits ``[T, E]`` (float32). ``weights_for(logits, route(logits)[0])`` equals ``route(logits)[1]``; with
        other ids it is how the frozen router would weigh a replayed choice."""
        logits = logits.float()
        if self.kind == "topk_softmax":
            weights = torch.softmax(logits.gather(1, ids), dim=-1)
        elif self.kind == "topk_sigmoid":
            weights = logits.gather(1, ids).sigmoid()
        elif self.kind == "bias_topk_sigmoid":
            weights = self._sigmoid_of_chosen(logits, ids)
        elif self.kind == "sparsemixer":
            weights = self._sparsemixer_weights(logits, ids)
        elif self.kind == "softmax_bias_topk":
            weights = self._clamped_normalised(torch.softmax(logits, dim=-1).gather(1, ids))
        elif self.kind == "sigmoid_shared_topk":
            if ids.shape[-1] == self.top_k:
                ids = self._with_shared(ids, logits.shape[-1] - self.shared)
            weights = self._shared_normalised(logits, ids)
        else:
            scores = self._scores(logits) if self.kind == "sigmoid_group_topk" else torch.softmax(logits, dim=-1)
            weights = scores.gather(1, ids)
            if self.normalize and self.kind == "softmax_topk":
                weights = weights / self._norm(weights)
            elif self.normalize:
                eps = {"sigmoid_group_topk": self.norm_eps}.get(self.kind, 1e-20)
                weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
        return weights * self.scaling

    def _norm(self, weights: torch.Tensor) -> torch.Tensor:
        """What ``softmax_topk`` divides the chosen weights by: their sum, or their :attr:`norm_p`-norm."""
        if self.norm_p is None:
            return weights.sum(dim=-1, keepdim=True)
        return torch.norm(weights, p=self.norm_p, dim=-1, keepdim=True)

    def _with_shared(self, ids: torch.Tensor, routed: int) -> torch.Tensor:
        """The chosen routed experts' ids ``[T, k]`` followed by the shared experts' (``routed``, ``routed + 1``...)."""
        shared = torch.arange(routed, routed + self.shared, device=ids.device).expand(ids.shape[0], -1)
        return torch.cat([ids, shared], dim=-1)

    def _shared_normalised(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each of ``ids``'s sigmoid over their sum, as Inkling's router computes it (in log space)."""
        log_probs = torch.nn.functional.logsigmoid(logits.gather(1, ids))
        return torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(logits).sqrt() if self.score == "sqrtsoftplus" else logits.sigmoid()

    def _clamped_normalised(self, weights: torch.Tensor) -> torch.Tensor:
        return weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min) if self.normalize else weights

    def _sigmoid_of_chosen(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        weights = logits.gather(1, ids).sigmoid()
        return weights / weights.sum(dim=-1, keepdim=True) if self.normalize else weights

    def _sparsemixer_weights(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each of the two experts' softmax weight among the logits close to its own (the first expert's logit
        out of the second's competition), as transformers' ``sparsemixer`` computes them in eval mode."""
        weights = []
        competing = logits
        for slot in range(2):
            chosen = competing.gather(1, ids[:, slot : slot + 1])
            factor = logits.abs().clamp(min=chosen)
            far = ((chosen - logits) / factor) > 2 * self.jitter_eps
            gates = torch.softmax(competing.masked_fill(far, float("-inf")), dim=-1)
            weights.append(gates.gather(1, ids[:, slot : slot + 1]))
            competing = competing.scatter(1, ids[:, slot : slot + 1], float("-inf"))
        return torch.cat(weights, dim=1)

    def _restrict_to_groups(self, scores: torch.Tensor, group_size_reduce: str, fill: float) -> torch.Tensor:
        tokens, experts = scores.shape
        grouped = scores.view(tokens, self.n_group, experts // self.n_group)
        if group_size_reduce == "top2":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_ids = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
        return scores.masked_fill(~expert_mask, fill)
