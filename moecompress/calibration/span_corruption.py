"""Calibration batches for a T5-style encoder-decoder (Switch Transformers): T5's span corruption of each window.

Chosen because it is the task switch-base-8 was pre-trained on, so the encoder sees sources and the decoder targets
of the distribution each stack learnt. The same text as source and target would keep the stacks' token counts equal,
but is a copy task the model never learnt. As T5's ``random_spans_noise_mask``: 15% of a window's tokens, in spans of
mean length 3, alternating with kept spans (a kept span first, a noise span last), every window of a length split
alike (so the batches stay rectangular) at positions drawn from the seed; the source is the kept spans with the
``i``-th noise span replaced by sentinel ``i``, the target the sentinels each followed by its span, both ending with
EOS. Each token keeps its tag; a sentinel takes its span's first token's, EOS the window's last token's.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from ..errors import UserInputError

NOISE_DENSITY = 0.15
MEAN_SPAN_LENGTH = 3.0


@dataclass
class Seq2SeqWindows:
    """Source, target and decoder input of each window, with the tag of every token of each."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    decoder_input_ids: torch.Tensor
    source_tags: torch.Tensor
    decoder_tags: torch.Tensor
    """Aligned with ``decoder_input_ids`` (what the decoder's layers see), each position the tag of its token."""


def span_lengths(length: int, generator: torch.Generator) -> list[tuple[int, int]]:
    """``(kept, noise)`` span lengths of a window of ``length`` tokens, in order (T5's ``random_spans_noise_mask``)."""
    noise = min(max(round(length * NOISE_DENSITY), 1), length - 1)
    spans = max(round(noise / MEAN_SPAN_LENGTH), 1)

    def segments(items: int) -> list[int]:
        cuts = torch.randperm(items - 1, generator=generator)[: spans - 1].add(1).sort().values.tolist()
        bounds = [0, *cuts, items]
        return [end - start for start, end in pairwise(bounds)]

    noise_spans = segments(noise)
    return list(zip(segments(length - noise), noise_spans, strict=True))


def corrupt_spans(
    input_ids: torch.Tensor,
    tags: torch.Tensor,
    sentinel_ids: list[int],
    eos_id: int,
    decoder_start_id: int,
    seed: int,
) -> Seq2SeqWindows:
    """Span-corrupted ``input_ids`` ``[N, L]`` (tags ``[N, L]``) with sentinel ``i`` ``sentinel_ids[i]``."""
    count, length = input_ids.shape
    generator = torch.Generator().manual_seed(seed)
    sources, targets, source_tags, target_tags = [], [], [], []
    for ids, row_tags in zip(input_ids.tolist(), tags.tolist(), strict=True):
        spans = span_lengths(length, generator)
        if len(spans) > len(sentinel_ids):
            raise UserInputError(
                f"span corruption of {length}-token windows needs {len(spans)} sentinel tokens; the tokenizer has "
                f"{len(sentinel_ids)} (<extra_id_N>)"
            )
        source, target, s_tags, t_tags, at = [], [], [], [], 0
        for index, (kept, noise) in enumerate(spans):
            source += ids[at : at + kept]
            s_tags += row_tags[at : at + kept]
            at += kept
            source.append(sentinel_ids[index])
            s_tags.append(row_tags[at])
            target += [sentinel_ids[index], *ids[at : at + noise]]
            t_tags += [row_tags[at], *row_tags[at : at + noise]]
            at += noise
        sources.append([*source, eos_id])
        targets.append([*target, eos_id])
        source_tags.append([*s_tags, row_tags[-1]])
        target_tags.append([*t_tags, row_tags[-1]])
    labels = torch.tensor(targets, dtype=input_ids.dtype).reshape(count, -1)
    label_tags = torch.tensor(target_tags, dtype=tags.dtype).reshape(count, -1)
    start = torch.full((count, 1), decoder_start_id, dtype=labels.dtype)
    return Seq2SeqWindows(
        input_ids=torch.tensor(sources, dtype=input_ids.dtype).reshape(count, -1),
        labels=labels,
        decoder_input_ids=torch.cat([start, labels[:, :-1]], dim=1),
        source_tags=torch.tensor(source_tags, dtype=tags.dtype).reshape(count, -1),
        decoder_tags=torch.cat([label_tags[:, :1], label_tags[:, :-1]], dim=1),
    )
