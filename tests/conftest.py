import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(2)

from moecompress.synthetic import FAMILIES, save_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    """One saved tiny random checkpoint per family, built once per test session."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: save_tiny_model(family, root / family) for family in FAMILIES}
