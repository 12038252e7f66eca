"""Calibration batches for a T5-style encoder-decoder (Switch Transformers): T5's span corruption of each window.

Chosen because it is the task switch-base-8 was pre-trained on, so the encoder sees sources and the decoder targets
of the distribution each stack learnt. The same text as source and target would keep the stacks' token counts equal,
but is a copy task the model never learnt. As T5's ``random_spans_noise_mask``: 15% of a window's tokens, in spans of
mean length 3, alternating with kept spans (a kept span first, a noise span last), every window of a length split
alike (so the batches stay rectangular) at positions drawn from the seed; the source is the kept spans with the
``i``-th noise span replaced by sentinel ``i``, the target the sentinels each followed by its span, both ending with
EOS. Each token keeps its tag; a sentinel takes its span's first token's, EOS the window's last token's.

The decoder's tags travel inside each batch under :data:`DECODER_TAGS` (so that splitting the batches, as sharding
does, keeps them with their tokens); :class:`~moecompress.sweep.engine.CalibrationSweep` takes them out as its
``decoder_tags`` and :func:`model_inputs` drops them before a forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from ..errors import UserInputError

DECODER_TAGS = "decoder_tags"
TARGETS = "targets"
"""An evaluation batch's key for the ids its logits predict, position by position (the decoder's labels)."""
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

    @property
    def num_tokens(self) -> int:
        """The tokens the model runs on: the sources' and the decoder inputs'."""
        return self.input_ids.numel() + self.decoder_input_ids.numel()


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


def sentinel_ids(tokenizer) -> list[int]:
    """The ids of T5's sentinels ``<extra_id_0>``, ``<extra_id_1>``, ... in the tokenizer, in order."""
    unknown = tokenizer.unk_token_id
    ids = []
    while (token := tokenizer.convert_tokens_to_ids(f"<extra_id_{len(ids)}>")) is not None and token != unknown:
        ids.append(token)
    return ids


def seq2seq_windows(input_ids: torch.Tensor, tags: torch.Tensor, tokenizer, config: dict, seed: int) -> Seq2SeqWindows:
    """:func:`corrupt_spans` with the tokenizer's sentinels and EOS and the config's decoder start."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.get("eos_token_id")
    start = config.get("decoder_start_token_id")
    if eos is None or start is None:
        raise UserInputError("span corruption needs the tokenizer's EOS and the config's decoder_start_token_id")
    return corrupt_spans(input_ids, tags, sentinel_ids(tokenizer), int(eos), int(start), seed)


def seq2seq_batches(
    input_ids: torch.Tensor, tags: torch.Tensor, tokenizer, config: dict, batch_size: int, seed: int
) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """Calibration batches of an encoder-decoder from windows ``input_ids`` ``[N, L]`` (tags ``[N, L]``): the
    corrupted source as ``input_ids``, ``decoder_input_ids``, the decoder's tags under :data:`DECODER_TAGS`; and
    the flat tags of the sources' tokens."""
    windows = seq2seq_windows(input_ids, tags, tokenizer, config, seed)
    batches = [
        {
            "input_ids": windows.input_ids[at : at + batch_size],
            "decoder_input_ids": windows.decoder_input_ids[at : at + batch_size],
            DECODER_TAGS: windows.decoder_tags[at : at + batch_size],
        }
        for at in range(0, windows.input_ids.shape[0], batch_size)
    ]
    return batches, windows.source_tags.reshape(-1)


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` without the decoder's tags and the evaluation's targets: the model forward's keyword arguments."""
    return {key: value for key, value in batch.items() if key not in (DECODER_TAGS, TARGETS)}
