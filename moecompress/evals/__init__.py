"""Evaluation: perplexity, KL to a reference, routing agreement, footprint, speed."""
