"""moecompress: compress Hugging Face Mixture-of-Experts checkpoints.

Importing the package registers what stock transformers needs to load moecompress outputs whose MoE layers
hold different numbers of experts (see :mod:`moecompress.plugin`).
"""

__version__ = "0.1.0"

from . import plugin as _plugin

_plugin.install()
