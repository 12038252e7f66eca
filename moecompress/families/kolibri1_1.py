"""Kolibri 1.1 (``kolibri1_1``, Aleph Alpha): Kolibri's MoE block and release names, dense MLPs in ``mlp_only_layers``,
and attention that hands state to later layers (carried by the layer sweep, :mod:`moecompress.sweep.layer_carry`): each
decoder layer returns ``(hidden, index_pool)``, the candidate keys of the latest indexer, which the next layer takes as
``index_pool`` (an indexer selects a new pool and ignores the one it is given); a ``kv_source_layers`` source writes its
keys and values into the forward's ``shared_kv_states`` under ``str(layer)`` and the layers that name it read them from
there.
"""

from __future__ import annotations

from typing import ClassVar

from .kolibri import Kolibri1Adapter


class Kolibri1_1Adapter(Kolibri1Adapter):
    family = "kolibri1_1"
    model_types = ("kolibri1_1",)
    layer_returns_tuple = True
    carried_outputs: ClassVar[dict[int, str]] = {1: "index_pool"}
    shared_state_keyword = "shared_kv_states"

    def is_moe_layer(self, layer: int) -> bool:
        dense = self.text_config.get("mlp_only_layers")
        if dense is None:
            dense = [i for i in (0, 1) if i < self.num_layers]
        return self.num_experts > 0 and layer not in dense

    def shared_state_sources(self, layer: int) -> list[int]:
        sources = self.text_config.get("kv_source_layers")
        return [int(sources[layer])] if sources and int(sources[layer]) != layer else []
