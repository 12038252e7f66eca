"""Attention-head pruning: the prunable units of a layer, learnable binary gates with a sparsity objective, masks
applied to a loaded model, and the physical removal of heads from checkpoint tensors."""

from .gates import HeadGates, SparsityLagrangian
from .layout import HeadLayout, Unit
from .masks import GateMasks
from .slicing import slice_attention

__all__ = ["GateMasks", "HeadGates", "HeadLayout", "SparsityLagrangian", "Unit", "slice_attention"]
