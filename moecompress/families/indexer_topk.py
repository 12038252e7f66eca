"""Decoder layers whose sparse-attention indexer hands its top-k to the next layer (GLM-5, GLM-5.3-Flash, HY-V4,
Mistral Large 4): each layer returns ``(hidden, top-k)`` and the next takes that top-k as ``prev_topk_indices`` (an
``indexer_types`` ``shared`` layer attends over it instead of running an indexer); the layer sweep carries it
(:mod:`moecompress.sweep.layer_carry`)."""

from __future__ import annotations

from typing import ClassVar


class CarriedIndexerTopK:
    """Mixin, listed before the family's adapter class."""

    layer_returns_tuple: ClassVar[bool] = True
    carried_outputs: ClassVar[dict[int, str]] = {1: "prev_topk_indices"}
