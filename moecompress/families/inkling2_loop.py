"""Inkling 2 Loop (``inkling2_loop_text``; ``inkling2_loop`` with its vision tower): Inkling 2 whose decoder layers
``loop_layer_index_start`` to ``loop_layer_index_end - 1`` (the *looped segment*) run ``loop_num_passes`` times.

Each pass after the first starts again from the hidden states and block stack that entered the segment, and each of
its layers reads *messages* ``[B, S, 4, H]``: attention (``message_input``, queries ``[L_loop, 4, H]``) over the
previous pass's block-boundary inputs inside the segment (past the segment's first) and its output, which gates
(``{q,k,v,mlp}_message_gate``) mix into the layer's query, key, value and MoE inputs. So a looped layer's experts see
``loop_num_passes`` inputs per token; the calibration sweep runs the segment pass by pass
(:meth:`~moecompress.sweep.engine.CalibrationSweep.run`) and a looped layer's capture holds the inputs of all its
passes.

Layout: Inkling 2's native names (:mod:`.inkling2`), and the loop's: the gates as ``controllers.{attn,k,v,mlp}.
{down,gain,forget}_weight`` in each looped layer, the message queries outside the layers as
``model.llm.middle_cycle_cross_pass_queries`` (each looped layer's query and MoE queries, ``[2 L_loop, H]``) and
``model.llm.middle_cycle_cross_pass_kv_queries`` (its key and value queries), which transformers merges into
``message_input.query`` at load (``Inkling2LoopMergeMessageQueries``).
"""

from __future__ import annotations

import torch

from .inkling2 import _LOCAL, _OUTSIDE, _STORED, Inkling2Adapter, Inkling2TextAdapter
from .native_names import compile_renames

_LOOP_LOCAL = compile_renames(
    (r"^controllers\.attn\.", "q_message_gate."),
    (r"^controllers\.(k|v|mlp)\.", r"\1_message_gate."),
    (r"_message_gate\.down_weight$", "_message_gate.down_proj.weight"),
    (r"_message_gate\.gain_weight$", "_message_gate.message_gate_proj.weight"),
    (r"_message_gate\.forget_weight$", "_message_gate.forget_gate_proj.weight"),
)
_LOOP_STORED = compile_renames(
    (r"_message_gate\.down_proj\.weight$", "_message_gate.down_weight"),
    (r"_message_gate\.message_gate_proj\.weight$", "_message_gate.gain_weight"),
    (r"_message_gate\.forget_gate_proj\.weight$", "_message_gate.forget_weight"),
    (r"^q_message_gate\.", "controllers.attn."),
    (r"^(k|v|mlp)_message_gate\.", r"controllers.\1."),
)
_QUERIES = "model.llm.middle_cycle_cross_pass_queries"
_KV_QUERIES = "model.llm.middle_cycle_cross_pass_kv_queries"


def merged_message_queries(queries: torch.Tensor, kv_queries: torch.Tensor) -> torch.Tensor:
    """``message_input.query`` ``[L_loop, 4, H]`` (query, key, value, MoE) from the two stored tensors, as
    transformers' ``Inkling2LoopMergeMessageQueries`` merges them."""
    queries, kv_queries = queries.unflatten(0, (-1, 2)), kv_queries.unflatten(0, (-1, 2))
    return torch.cat([queries[:, :1], kv_queries, queries[:, 1:]], dim=1)


class Inkling2LoopTextAdapter(Inkling2TextAdapter):
    family = "inkling2_loop_text"
    model_types = ("inkling2_loop_text",)
    local_renames = _LOOP_LOCAL + _LOCAL
    stored_renames = _LOOP_STORED + _STORED
    outside_prefixes = ((_QUERIES, "model.message_input.query"), *_OUTSIDE)
    message_input_module = "model.message_input"
    message_argument = 1

    @property
    def loop_layers(self) -> range:
        cfg = self.text_config
        return range(int(cfg["loop_layer_index_start"]), int(cfg["loop_layer_index_end"]))

    @property
    def loop_passes(self) -> int:
        return int(self.text_config["loop_num_passes"])

    def classify_key(self, key: str):
        if key in (_QUERIES, _KV_QUERIES):
            return "attention"
        return super().classify_key(key)

    def runtime_outside_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Also the message queries merged into ``message_input.query``."""
        state = dict(state)
        if _QUERIES in state:
            state[_QUERIES] = merged_message_queries(state[_QUERIES], state.pop(_KV_QUERIES))
        return super().runtime_outside_state(state)


class Inkling2LoopAdapter(Inkling2Adapter, Inkling2LoopTextAdapter):
    """The ``inkling2_loop`` release: :class:`Inkling2LoopTextAdapter`'s text model at runtime
    ``model.language_model`` beside the vision tower ``model.visual`` (passed through untouched)."""

    family = "inkling2_loop"
    model_types = ("inkling2_loop",)
    message_input_module = "model.language_model.message_input"
