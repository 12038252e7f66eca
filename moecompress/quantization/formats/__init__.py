"""How a quantised checkpoint is laid out on disk: the registered output formats (the native format and the
exports that need no plugin); importing this package registers the built-in ones, one line each, in the order the
options list them."""

# isort: off
from . import native  # noqa: F401
from . import gpt_oss  # noqa: F401
from . import compressed_tensors  # noqa: F401

# isort: on
from .base import FORMATS, OUTPUT_FORMATS, OutputFormat, format_of, register, unregister, written_format

__all__ = ["FORMATS", "OUTPUT_FORMATS", "OutputFormat", "format_of", "register", "unregister", "written_format"]
