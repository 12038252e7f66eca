"""ERNIE 4.5 VL (``ernie4_5_vl_moe``): two expert sets per MoE layer, text and vision, each token routed within its
own modality's set (transformers' ``mlp.text_moe`` / ``mlp.vision_moe``, picked by ``moe_mm_token_type_ids``).

On disk (a stock ``save_pretrained``): per MoE layer ``mlp.experts.{0..2E-1}`` (the first ``E`` the text set at
``moe_intermediate_size[0]``, the last ``E`` the vision set at ``moe_intermediate_size[1]``), routers
``mlp.gate.weight`` (text) and ``mlp.gate.weight_1`` (vision) stored ``[H, E]``,
``mlp.moe_statics.e_score_correction_bias`` ``[2, E]``, ``mlp.shared_experts``; the text model under ``model.*``
beside ``model.vision_model.*`` and ``model.resampler_model.*``. Stock transformers builds both sets from one
``moe_num_experts``, so every selection keeps the same count in both.

The view holds both sets as one block of ``2E`` experts (text first), the narrower set's channels zero-padded to the
wider width (``silu(0) * 0`` is 0 and the padded ``down`` columns are 0, so each expert computes what it computes
unpadded; the writer strips the padding). The router spans ``2E`` columns and each token is routed within its set:
every token the sweeps run is text (this adapter takes no images), so the rule runs on the text columns alone, as
``text_moe``'s router does. Selection sees the sets as two router groups of equal size
(:attr:`~.routing.RoutingRule.n_group`), so every prune method and merge keeps equal counts in both.

Text calibration never reaches the vision set. Its experts are ranked by the one statistic of the image tokens the
checkpoint carries, the vision router's ``e_score_correction_bias`` (auxiliary-loss-free balancing lowers an
expert's bias while it is chosen more than its share): lowest bias kept first, ties to the lower id
(:meth:`Ernie45VLMoeAdapter.scores_without_tokens`).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import UserInputError
from .base import Layout, MoEWeights
from .ernie import Ernie45MoeAdapter
from .routing import RoutingRule
from .text_under_model import TextUnderModel

_SETS = ("text_moe", "vision_moe")


class Ernie45VLMoeAdapter(TextUnderModel, Ernie45MoeAdapter):
    family = "ernie4_5_vl_moe"
    model_types = ("ernie4_5_vl_moe",)
    vision_prefixes = ("model.vision_model.", "model.resampler_model.")
    router_module = "mlp.text_moe.gate"
    router_transposed = True
    expert_set_modules = tuple(f"mlp.{name}.experts" for name in _SETS)

    @property
    def moe_site_module(self) -> str:
        """The whole MoE block ``mlp``: ``text_moe`` returns its tokens flattened to one dimension."""
        return "mlp"

    # ---- config ---------------------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        """Routed experts of a MoE layer, both sets: twice ``moe_num_experts``."""
        return 2 * int(self.text_config.get("moe_num_experts") or 0)

    def is_moe_layer(self, layer: int) -> bool:
        return self.listed_moe_layer(layer, otherwise=super().is_moe_layer(layer))

    def set_widths(self) -> tuple[int, int]:
        """The text and vision experts' intermediate sizes."""
        widths = self.text_config.get("moe_intermediate_size") or [1536, 512]
        return int(widths[0]), int(widths[1])

    def first_expert_width(self, layer: int) -> int | None:
        return self.set_widths()[0]

    def stored_router_columns(self, layer: int) -> int:
        return self.experts_in_layer(layer) // 2

    def routing_rule(self) -> RoutingRule:
        rule = super().routing_rule()
        return RoutingRule(rule.kind, top_k=rule.top_k, norm_min=rule.norm_min, n_group=2, topk_group=1)

    def with_expert_counts(self, counts: dict[int, int], kept: dict[int, list[int]]) -> dict[str, Any]:
        if len(set(counts.values())) != 1 or any(n % 2 for n in counts.values()):
            raise UserInputError(
                f"{self.family}: stock transformers builds every MoE layer's text and vision sets from one "
                f"moe_num_experts; the pruned counts {sorted(set(counts.values()))} are not one even count per layer"
            )
        return super().with_expert_counts({layer: n // 2 for layer, n in counts.items()}, kept)

    def check_expert_pruning(self, source: str = "model", config: Any = None) -> None:
        """Global ranking keeps different counts per layer, which one ``moe_num_experts`` cannot describe."""
        from ..errors import OptionError
        from ..vocabulary import named

        if config is not None and getattr(config, "scope", None) == "global":
            raise OptionError(
                f"{source}: {self.family} builds every MoE layer's text and vision sets from one moe_num_experts, so "
                f"each layer keeps the same count: {named('scope', 'global')} cannot be written (use "
                f"{named('scope', 'layer')})",
                type(config),
            )

    # ---- routing --------------------------------------------------------------------------------------
    def route(
        self,
        moe: MoEWeights,
        logits: torch.Tensor,
        allowed: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The text set's rule on its columns: the view's ``[T, 2E]`` logits or the stock text router's ``[T, E]``
        (ids are positions in the text set, which are the view's first ``E``)."""
        half = moe.num_experts // 2
        logits = logits[:, :half]
        bias = None if moe.correction_bias is None else moe.correction_bias[:half].to(logits.device)
        if allowed is not None:
            allowed = allowed[..., :half]
        return self.routing_rule().route(logits, bias, allowed)

    def scores_without_tokens(self, moe: MoEWeights, score: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``score`` with the vision set's entries replaced, where no calibration token reached it, by its rank under
        the vision router's correction bias (lowest bias scores highest, ties to the lower position)."""
        half = moe.num_experts // 2
        if counts[half : moe.num_experts].sum() > 0:
            return score
        bias = moe.correction_bias[half:] if moe.correction_bias is not None else torch.zeros(half)
        order = sorted(range(half), key=lambda e: (float(bias[e]), e))
        ranked = score.clone()
        for rank, position in enumerate(order):
            ranked[half + position] = float(half - rank)
        return ranked

    # ---- layer tensors <-> MoE view ---------------------------------------------------------------------
    def split_layer(self, layer: int, tensors: dict[str, torch.Tensor], *, consume: bool = False):
        from ..checkpoint.reader import materialise

        if not self.is_moe_layer(layer):
            return super().split_layer(layer, tensors, consume=consume)
        own = dict(tensors)
        if consume:
            tensors.clear()
        text = materialise(own.pop(self._router_key(layer, "weight")))
        vision = materialise(own.pop(self._router_key(layer, "weight_1")))
        own[self._router_key(layer, "weight")] = torch.cat([text.t(), vision.t()]).contiguous()
        return super().split_layer(layer, own, consume=True)

    def _pop_experts(self, layer: int, rest: dict[str, torch.Tensor], layout: Layout) -> MoEWeights:
        from ..checkpoint.reader import materialise

        if layout != "per_expert":
            raise UserInputError(f"{self.family}: layer {layer}: experts stored fused; expected per-expert tensors")
        pattern = re.compile(re.escape(f"{self.layer_prefix(layer)}{self.moe_disk_prefix}experts.") + r"(\d+)\.")
        count = len({int(m.group(1)) for key in rest if (m := pattern.match(key))})
        wide = max(self.set_widths())
        first = rest[self._expert_key(layer, 0, 0)]
        hidden, dtype = first.shape[1], first.dtype
        gate_up = torch.zeros((count, 2 * wide, hidden), dtype=dtype, device="cpu")
        down = torch.zeros((count, hidden, wide), dtype=dtype, device="cpu")
        for expert in range(count):
            width = self.set_widths()[self._set_of(expert, count)]
            parts = {
                0: gate_up[expert, :width],
                1: gate_up[expert, wide : wide + width],
                2: down[expert, :, :width],
            }
            for which, target in parts.items():
                key = self._expert_key(layer, expert, which)
                tensor = materialise(rest.pop(key))
                if tuple(tensor.shape) != tuple(target.shape):
                    raise UserInputError(
                        f"{key}: shape {list(tensor.shape)}, but moe_intermediate_size implies {list(target.shape)}"
                    )
                target.copy_(tensor)
        return MoEWeights(router_weight=torch.empty(0, device="cpu"), gate_up=gate_up, down=down)

    @staticmethod
    def _set_of(position: int, count: int) -> int:
        return 0 if position < count // 2 else 1

    def set_experts(self, moe: MoEWeights, which: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Set ``which``'s (0 text, 1 vision) experts unpadded, as transformers holds them: ``gate_up_proj``
        ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``."""
        half, wide = moe.num_experts // 2, moe.intermediate_size
        width = self.set_widths()[which]
        rows = slice(which * half, (which + 1) * half)
        gate_up = torch.cat([moe.gate_up[rows, :width], moe.gate_up[rows, wide : wide + width]], dim=1)
        return gate_up.contiguous(), moe.down[rows, :, :width].contiguous()

    def _expert_tensors(self, layer: int, moe: MoEWeights, layout: Layout | None) -> dict[str, torch.Tensor]:
        out = {}
        half = moe.num_experts // 2
        for which in (0, 1):
            gate_up, down = self.set_experts(moe, which)
            width = gate_up.shape[1] // 2
            for index in range(half):
                expert = which * half + index
                out[self._expert_key(layer, expert, 0)] = gate_up[index, :width].contiguous()
                out[self._expert_key(layer, expert, 1)] = gate_up[index, width:].contiguous()
                out[self._expert_key(layer, expert, 2)] = down[index].contiguous()
        return out

    def join_layer(self, layer: int, moe: MoEWeights | None, rest: dict[str, torch.Tensor], layout: Layout | None):
        out = super().join_layer(layer, moe, rest, layout)
        if moe is None:
            return out
        half = moe.num_experts // 2
        key = self._router_key(layer, "weight")
        router = out.pop(key)
        out[key] = router[:half].t().contiguous()
        out[self._router_key(layer, "weight_1")] = router[half:].t().contiguous()
        bias_key = self._router_key(layer, "e_score_correction_bias")
        if bias_key in out:
            out[bias_key] = out[bias_key].reshape(2, -1)
        return out

    def experts_refusal(self, scheme: Any) -> str | None:
        """The sets are cut from the padded block along the input columns of ``down`` at a group boundary, and
        salient weights are coded over the whole block."""
        from ..vocabulary import named

        if scheme.salient_fraction:
            return (
                f"{self.family}'s text and vision experts are written as two modules cut from one block, and salient "
                f"weights are coded over the whole block: leave {named('salient_fraction')} at 0"
            )
        group = int(getattr(scheme, "group_size", 0) or 0)
        narrow = min(self.set_widths())
        if group and narrow % group:
            return (
                f"{self.family}'s expert sets are {'/'.join(map(str, self.set_widths()))} wide; the narrower is cut "
                f"from the wider at a group boundary, which {named('group_size', group)} does not give"
            )
        return None

    def quantized_expert_sets(self, moe: Any) -> list[Any]:
        """The quantised block's text and vision sets, each unpadded (the padded rows and columns cut off, with the
        low-rank adapters' padded rows and columns)."""
        from dataclasses import replace

        from ..quantization.slicing import columns_of, rows_of

        half, wide = moe.weights.num_experts // 2, moe.weights.intermediate_size
        parts = []
        for which, width in enumerate(self.set_widths()):
            experts = slice(which * half, (which + 1) * half)
            adapters = {}
            for (expert, matrix), (left, right) in moe.adapters.items():
                if experts.start <= expert < experts.stop:
                    trimmed = (left, right[:, :width]) if matrix == "down" else (left[:width], right)
                    adapters[(expert - experts.start, matrix)] = trimmed
            parts.append(
                replace(
                    moe,
                    weights=moe.weights.select(list(range(experts.start, experts.stop))),
                    gate_up=rows_of(moe.gate_up, experts, [slice(0, width), slice(wide, wide + width)]),
                    down=columns_of(moe.down, experts, width),
                    adapters=adapters,
                    _dequantized=None,
                )
            )
        return parts

    # ---- the loaded transformers model ------------------------------------------------------------------
    def runtime_moe_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        state = self.runtime_router_state(moe)
        for which, name in enumerate(_SETS):
            gate_up, down = self.set_experts(moe, which)
            state[f"mlp.{name}.experts.gate_up_proj"] = gate_up
            state[f"mlp.{name}.experts.down_proj"] = down
        return state

    def runtime_router_state(self, moe: MoEWeights) -> dict[str, torch.Tensor]:
        half = moe.num_experts // 2
        state = {}
        for which, name in enumerate(_SETS):
            rows = slice(which * half, (which + 1) * half)
            state[f"mlp.{name}.gate.weight"] = moe.router_weight[rows]
            if moe.correction_bias is not None:
                state[f"mlp.{name}.gate.moe_statics.e_score_correction_bias"] = moe.correction_bias[rows].reshape(1, -1)
        return state
