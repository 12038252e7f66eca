"""moecompress: compress Hugging Face Mixture-of-Experts checkpoints.

Importing the package registers what stock transformers needs to load moecompress outputs whose MoE layers
hold different numbers of experts (see :mod:`moecompress.plugin`).
"""

__version__ = "0.1.0"

import os as _os
import sys as _sys

if "torch" not in _sys.modules:
    # torch backs tensors of 2 MiB and more with transparent huge pages when this is set before it starts:
    # streaming a checkpoint allocates a layer's worth of fresh memory per layer, and with 4 KiB pages the
    # page faults cost about a quarter of an MXFP4 rewrite (BENCHMARKS.md). Set it to 0 to opt out.
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from . import plugin as _plugin

_plugin.install()
