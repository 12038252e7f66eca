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


def train_test_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer with the tiny models' 384-token vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from moecompress.calibration.builtin_corpus import builtin_documents

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((doc.text for doc in builtin_documents("prose", "calib")[:10]), trainer=trainer)
    assert tokenizer.get_vocab_size() == vocab_size
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tmp_path_factory) -> dict:
    """Tiny checkpoints of a few families that also carry a tokenizer, for evaluation tests."""
    root = tmp_path_factory.mktemp("tiny_tok")
    tokenizer = train_test_tokenizer()
    out = {}
    for family in ("qwen3_moe", "deepseek_v3", "gpt_oss"):
        path = save_tiny_model(family, root / family)
        tokenizer.save_pretrained(path)
        out[family] = path
    return out
