import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

TEST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
"""Set in each of pytest-xdist's worker processes: the suite runs one process a core, each with one torch thread (its
subprocesses too), instead of one process whose two threads wait on each other in small ops."""
if TEST_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"

# torch reads OMP_NUM_THREADS when it loads, so these imports follow the setting.
import pytest  # noqa: E402
import torch  # noqa: E402
from synthetic import FAMILIES, save_tiny_model, tiny_tokenizer  # noqa: E402

torch.set_num_threads(1 if TEST_WORKER else 2)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject.toml): a worker a core, but no more than one per 6 GiB of memory, since one worker's
    tests peak near 2.5 GB; ``-n 0`` runs the suite in this process."""
    cores = len(os.sched_getaffinity(0))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(cores, memory // (6 * 2**30)))


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
