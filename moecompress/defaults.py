"""Defaults that commands, recipes and the library share (a module without heavy imports, so that the command
line can read them before torch is loaded)."""

DEFAULT_EVAL_DATA = "builtin:prose"
DEFAULT_EVAL_TOKENS = 16384
"""The one evaluation default of every command and recipe: the first 16,384 tokens of the held-out part."""
