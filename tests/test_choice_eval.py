"""The multiple-choice check (moecompress.evals.choice): its items, its scoring and its determinism."""

from types import SimpleNamespace

import pytest
import torch
from synthetic import save_tiny_source

from moecompress.errors import UserInputError
from moecompress.evals.choice import (
    build_items,
    choice_items,
    evaluate_choice,
    score_items,
    summarize,
)
from moecompress.loading import load_adapter, load_model


def test_items_have_the_stated_shapes_and_places():
    ids = torch.arange(10_000)
    items = build_items(ids, context=8, length=4, items=20, distractors=3, seed=1)
    assert items.contexts.shape == (20, 8)
    assert items.continuations.shape == (20, 4, 4)
    stride = 10_000 // 20
    for i in range(20):
        start = i * stride
        assert torch.equal(items.contexts[i], ids[start : start + 8])
        assert torch.equal(items.continuations[i, 0], ids[start + 8 : start + 12])
        places = [int(span[0]) for span in items.continuations[i, 1:]]
        assert len(set(places)) == 3
        for place, span in zip(places, items.continuations[i, 1:], strict=True):
            assert torch.equal(span, ids[place : place + 4])  # a span of the same text
            assert place + 4 <= start or place >= start + 12  # never overlapping the item's own tokens
    again = build_items(ids, context=8, length=4, items=20, distractors=3, seed=1)
    other = build_items(ids, context=8, length=4, items=20, distractors=3, seed=2)
    assert torch.equal(again.continuations, items.continuations)
    assert torch.equal(other.continuations[:, 0], items.continuations[:, 0])
    assert not torch.equal(other.continuations[:, 1:], items.continuations[:, 1:])


def test_too_little_data_is_refused():
    with pytest.raises(UserInputError, match="too few for 4 items"):
        build_items(torch.arange(100), context=64, length=16, items=4)
    with pytest.raises(UserInputError, match="distinct"):
        build_items(torch.zeros(1000, dtype=torch.long), context=8, length=4, items=10)


class SuccessorModel(torch.nn.Module):
    """Predicts token x + 1 after token x with probability near 1 (or a uniform distribution)."""

    def __init__(self, vocab: int, uniform: bool = False):
        super().__init__()
        self.vocab, self.uniform = vocab, uniform
        self.device = torch.device("cpu")

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        if not self.uniform:
            logits.scatter_(-1, ((input_ids + 1) % self.vocab)[..., None], 20.0)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:], past_key_values=None)


def test_the_forced_true_continuation_ranks_first():
    ids = torch.arange(4000)
    items = build_items(ids, context=6, length=5, items=12, distractors=3, seed=0)
    scores = score_items(SuccessorModel(4001), items, items_per_forward=5)
    assert scores.shape == (12, 4)
    accuracy, margin = summarize(scores, 5)
    assert accuracy == 1.0
    # a distractor misses only its first token: about 20 nats of 5 tokens
    assert margin == pytest.approx(20.0 / 5, rel=0.01)
    # every continuation equally likely: ties never count as right
    accuracy, margin = summarize(score_items(SuccessorModel(4001, uniform=True), items), 5)
    assert accuracy == 0.0 and margin == 0.0


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    path = save_tiny_source("qwen3_moe", tmp_path_factory.mktemp("choice") / "qwen3_moe")
    return path


def test_shared_context_scores_equal_whole_sequences(tiny_qwen):
    items = choice_items(tiny_qwen, "builtin:prose:heldout", context=16, length=4, items=12)
    model = load_model(tiny_qwen, load_adapter(tiny_qwen))
    shared = score_items(model, items, items_per_forward=5)
    whole = score_items(model, items, items_per_forward=5, share_context=False)
    assert torch.allclose(shared, whole, atol=1e-4)
    assert shared.std() > 0


def test_the_check_is_deterministic(tiny_qwen):
    first = evaluate_choice(tiny_qwen, "builtin:code:heldout", context=16, length=4, items=16)
    second = evaluate_choice(tiny_qwen, "builtin:code:heldout", context=16, length=4, items=16)
    assert first == second
    assert first.items == 16 and first.distractors == 3
    assert 0.0 <= first.accuracy <= 1.0
