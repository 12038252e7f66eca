"""Tokenised token windows where every token carries its document's tag.

The token stream is defined once, here, for calibration and evaluation alike: each document's text followed by
``"\\n\\n"`` is tokenised without special tokens, and the documents are concatenated in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..defaults import CALIBRATION_LEAST
from ..errors import OptionError
from ..vocabulary import named
from .documents import Document

DOCUMENT_SEPARATOR = "\n\n"


@dataclass
class TokenStream:
    """All tokens of a list of documents, and per token the index of its tag in ``tag_names``."""

    ids: torch.Tensor
    tags: torch.Tensor
    tag_names: list[str]

    def __len__(self) -> int:
        return self.ids.numel()


@dataclass
class TokenWindows:
    """``[N, L]`` token ids with their ``[N, L]`` tag indices."""

    input_ids: torch.Tensor
    tags: torch.Tensor
    tag_names: list[str]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def batches(self, batch_size: int):
        for start in range(0, self.input_ids.shape[0], batch_size):
            yield self.input_ids[start : start + batch_size], self.tags[start : start + batch_size]


def tokenize_documents(documents: Sequence[Document], tokenizer) -> TokenStream:
    """The token stream of ``documents`` (see the module docstring)."""
    tag_names = sorted({doc.tag for doc in documents})
    tag_index = {name: i for i, name in enumerate(tag_names)}
    encoded = tokenizer([doc.text + DOCUMENT_SEPARATOR for doc in documents], add_special_tokens=False)["input_ids"]
    ids = torch.tensor([token for row in encoded for token in row], dtype=torch.long, device="cpu")
    tags = torch.tensor(
        [tag_index[doc.tag] for doc, row in zip(documents, encoded, strict=True) for _ in row],
        dtype=torch.long,
        device="cpu",
    )
    return TokenStream(ids=ids, tags=tags, tag_names=tag_names)


def consecutive_windows(stream: TokenStream, seq_len: int, max_tokens: int | None = None) -> TokenWindows:
    """Consecutive non-overlapping windows of ``seq_len`` tokens from the start (a partial last window is dropped),
    at most ``max_tokens`` tokens in all."""
    if seq_len < CALIBRATION_LEAST["seq_len"]:
        raise OptionError(f"{named('calibration.seq_len', seq_len)} must be at least {CALIBRATION_LEAST['seq_len']}")
    count = len(stream) // seq_len
    if max_tokens is not None:
        count = min(count, max_tokens // seq_len)
    if count == 0:
        raise OptionError(
            f"the data holds {len(stream)} tokens, fewer than one window of {seq_len} (or "
            f"{named('evaluation.tokens')} is too small)"
        )
    used = count * seq_len
    return TokenWindows(
        input_ids=stream.ids[:used].view(count, seq_len),
        tags=stream.tags[:used].view(count, seq_len),
        tag_names=stream.tag_names,
    )


def sampled_windows(stream: TokenStream, seq_len: int, num_tokens: int, seed: int) -> TokenWindows:
    """Windows of ``seq_len`` tokens at distinct random window-aligned offsets, ``num_tokens`` tokens in all
    (rounded down to whole windows), reproducible from ``seed``. A source too short for that is an error, not a
    silently smaller calibration set."""
    available = len(stream) // seq_len
    count = max(1, num_tokens // seq_len)
    if available < count:
        raise OptionError(
            f"the calibration data holds {available * seq_len} tokens in whole windows of {seq_len}, fewer than the "
            f"{count * seq_len} asked for; lower {named('calibration.tokens')} or add data"
        )
    generator = torch.Generator(device="cpu").manual_seed(seed)
    starts = torch.randperm(available, generator=generator, device="cpu")[:count].sort().values * seq_len
    offsets = starts[:, None] + torch.arange(seq_len, device="cpu")[None, :]
    return TokenWindows(input_ids=stream.ids[offsets], tags=stream.tags[offsets], tag_names=stream.tag_names)
