import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch
from synthetic import FAMILIES, save_tiny_model, tiny_tokenizer

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def commit_every_layer(monkeypatch):
    """Sweeps commit after every layer, so a test that stops a run can stop it between any two layers."""
    monkeypatch.setattr("moecompress.sweep.state.COMMIT_INTERVAL_S", 0.0)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict:
    """One saved tiny random checkpoint per family, built once per test session."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: save_tiny_model(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tmp_path_factory) -> dict:
    """Tiny checkpoints of a few families that also carry a tokenizer, for evaluation tests."""
    root = tmp_path_factory.mktemp("tiny_tok")
    tokenizer = tiny_tokenizer()
    out = {}
    for family in ("qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_vl_moe"):
        path = save_tiny_model(family, root / family)
        tokenizer.save_pretrained(path)
        out[family] = path
    return out
