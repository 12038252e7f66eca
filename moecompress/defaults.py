"""Defaults that commands, recipes and the library share (a module without heavy imports, so that the command
line can read them before torch is loaded)."""

DEFAULT_DATA = "builtin:prose"
"""The calibration source, and the evaluation data, of every command, recipe and library call."""
DEFAULT_CALIB_TOKENS = 16384
DEFAULT_SEQ_LEN = 256
"""Tokens per window of calibration, training and evaluation."""
DEFAULT_EVAL_DATA = DEFAULT_DATA
DEFAULT_EVAL_TOKENS = 16384
"""The one evaluation default of every command and recipe: the first 16,384 tokens of the held-out part."""
