"""The registered weight schemes; importing this package registers the built-in ones, one line each, in the
order the options list them."""

# isort: off
from . import mxfp4  # noqa: F401
from . import integer  # noqa: F401
from . import binary  # noqa: F401
from . import kquants  # noqa: F401

# isort: on
from .base import SCHEME_KINDS, Grid, SchemeKind, kind_of, register, unregister

__all__ = ["SCHEME_KINDS", "Grid", "SchemeKind", "kind_of", "register", "unregister"]
