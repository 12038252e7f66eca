"""moecompress: compress Hugging Face Mixture-of-Experts checkpoints."""

__version__ = "0.1.0"
