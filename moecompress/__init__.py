"""moecompress: compress Hugging Face Mixture-of-Experts checkpoints.

The Python API (see the README and :mod:`moecompress.api`)::

    import moecompress

    result = moecompress.quantize("builtin:tiny-moe", "tiny-mxfp4", scheme="mxfp4", evaluation=None)
    print(result.bytes_before, "->", result.bytes_after, "bytes;", result.bits_per_weight_after, "bits/weight")

:func:`prune`, :func:`quantize` and :func:`run` write a checkpoint and return a typed result; :func:`evaluate`
returns an :class:`~moecompress.evals.perplexity.EvalResult`.

Importing the package does one thing besides defining these: it registers what stock transformers needs to load
moecompress outputs (the native quantised format, and MoE layers holding different numbers of experts or heads;
see :mod:`moecompress.plugin`), which is why a script that loads an output imports moecompress first. That
registration is an import hook that patches transformers when its modeling code loads; beyond it the import sets
no environment variable or other process-wide state, and loads neither torch nor transformers.
"""

__version__ = "0.1.0"

from . import plugin as _plugin
from .api import CompressResult, PruneResult, QuantizeResult, RunResult, evaluate, prune, quantize, run

__all__ = [
    "CompressResult",
    "EvalResult",
    "PruneResult",
    "QuantizeResult",
    "RunResult",
    "evaluate",
    "prune",
    "quantize",
    "run",
]

_plugin.install()


def __getattr__(name: str):
    if name == "EvalResult":
        from .evals.perplexity import EvalResult

        return EvalResult
    raise AttributeError(f"module 'moecompress' has no attribute {name!r}")
