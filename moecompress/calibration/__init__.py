"""Calibration and evaluation data: sources, tokenised batches with per-token tags, capture."""
