"""Defaults that commands, recipes and the library share (a module without heavy imports, so that the command
line can read them before torch is loaded)."""

DEFAULT_DATA = "builtin:prose"
"""The calibration source, and the evaluation data, of every command, recipe and library call."""
DEFAULT_CALIB_TOKENS = 16384
DEFAULT_SEQ_LEN = 256
"""Tokens per window of calibration, training and evaluation."""
DEFAULT_IMAGE_SIZE = 224
"""Side in pixels that calibration images are drawn or resized to."""
DEFAULT_EVAL_DATA = DEFAULT_DATA
DEFAULT_EVAL_TOKENS = 16384
"""The one evaluation default of every command and recipe: the first 16,384 tokens of the held-out part."""

SCOPES: tuple[str, ...] = ("layer", "global")
"""Where pruning ranks what it removes: within each layer, or across all layers (experts and heads alike)."""

DEVICE_CHOICES = "auto|cpu|cuda|cuda:N"
"""Where a run computes, as every command, recipe and library call takes it (``auto``: CUDA when torch sees one)."""

CALIBRATION_LEAST = {"tokens": 1, "seq_len": 2, "seed": 0, "image_size": 8}
"""The smallest value of each calibration setting that commands, recipes and the library accept (a window of 2
tokens is the least that predicts one)."""
EVAL_TOKENS_LEAST = 2
"""The fewest tokens an evaluation takes (None: all)."""
