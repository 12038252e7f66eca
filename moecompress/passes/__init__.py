"""Compression passes: each reads a layer capture and rewrites the layer's MoE view."""
