"""T5 span corruption of calibration windows (Switch Transformers' calibration data)."""

import pytest
import torch

from moecompress.calibration.span_corruption import corrupt_spans, span_lengths
from moecompress.errors import UserInputError

SENTINELS = [999 - i for i in range(100)]
EOS, START = 1, 0


def _windows(count=3, length=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, 900, (count, length), generator=generator), torch.randint(0, 4, (count, length))


def _restore(source: list[int], target: list[int]) -> list[int]:
    """The window the source and target came from: each sentinel in the source replaced by its span."""
    spans, current = {}, None
    for token in target[:-1]:
        if token in SENTINELS:
            current = spans.setdefault(token, [])
        else:
            current.append(token)
    return [t for token in source[:-1] for t in (spans[token] if token in SENTINELS else [token])]


def test_spans_cover_the_window_with_t5s_density_and_mean_length():
    spans = span_lengths(512, torch.Generator().manual_seed(1))
    assert sum(k + n for k, n in spans) == 512 and all(k > 0 and n > 0 for k, n in spans)
    assert sum(n for _, n in spans) == round(512 * 0.15) and len(spans) == round(77 / 3)


def test_source_and_target_together_are_the_window_and_the_decoder_input_is_the_shifted_target():
    ids, tags = _windows()
    windows = corrupt_spans(ids, tags, SENTINELS, EOS, START, seed=7)
    for row in range(ids.shape[0]):
        source, target = windows.input_ids[row].tolist(), windows.labels[row].tolist()
        assert source[-1] == EOS and target[-1] == EOS and target[0] == SENTINELS[0]
        assert _restore(source, target) == ids[row].tolist()
    assert windows.decoder_input_ids[:, 0].eq(START).all()
    assert torch.equal(windows.decoder_input_ids[:, 1:], windows.labels[:, :-1])
    assert windows.input_ids.shape[1] < ids.shape[1] < windows.input_ids.shape[1] + windows.labels.shape[1]
    assert not torch.equal(windows.input_ids[0], windows.input_ids[1][: windows.input_ids.shape[1]])


def test_every_token_keeps_its_tag_and_a_sentinel_takes_its_spans_first():
    ids = torch.arange(2, 66).reshape(1, 64)
    tags = torch.arange(64).reshape(1, 64)
    windows = corrupt_spans(ids, tags, SENTINELS, EOS, START, seed=3)
    source, source_tags = windows.input_ids[0].tolist(), windows.source_tags[0].tolist()
    target = windows.labels[0].tolist()
    for position, token in enumerate(source[:-1]):
        if token in SENTINELS:
            first = target[target.index(token) + 1]
            assert source_tags[position] == first - 2
        else:
            assert source_tags[position] == token - 2
    label_tags = [tag for tag in windows.decoder_tags[0].tolist()[1:]] + [63]
    for position, token in enumerate(target[:-1]):
        expected = target[position + 1] - 2 if token in SENTINELS else token - 2
        assert label_tags[position] == expected
    assert windows.decoder_tags[0, 0] == windows.decoder_tags[0, 1]


def test_the_same_seed_gives_the_same_batches_and_too_few_sentinels_are_refused():
    ids, tags = _windows()
    first, again = (
        corrupt_spans(ids, tags, SENTINELS, EOS, START, 5),
        corrupt_spans(ids, tags, SENTINELS, EOS, START, 5),
    )
    assert torch.equal(first.input_ids, again.input_ids) and torch.equal(first.labels, again.labels)
    with pytest.raises(UserInputError, match="needs 3 sentinel tokens; the tokenizer has 2"):
        corrupt_spans(ids, tags, SENTINELS[:2], EOS, START, 5)
