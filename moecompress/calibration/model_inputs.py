"""A calibration source as the model's input batches: text windows, an encoder-decoder's span corruption, or
image-caption pairs, whatever family the adapter describes. Every pass that calibrates draws its batches here."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserInputError
from ..families import FamilyAdapter
from ..loading import load_tokenizer
from .batches import sampled_windows, tokenize_documents
from .sources import load_documents
from .span_corruption import seq2seq_batches
from .vision import image_processor_for, load_image_captions, vision_batches


def calibration_batches(
    adapter: FamilyAdapter,
    model_dir: Path,
    calib: str,
    calib_tokens: int,
    seq_len: int,
    batch_size: int,
    seed: int,
    image_size: int,
) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor, list[str]]:
    """Model-input batches, the flat tag index of every token, and the tag names, for text or image sources. An
    encoder-decoder's are T5's span corruption of the windows, its decoder's tags in the batches
    (:mod:`~moecompress.calibration.span_corruption`); the flat tags are its sources'."""
    tokenizer = load_tokenizer(model_dir)
    items = load_image_captions(calib, seed=seed, size=image_size)
    if items is not None:
        if not adapter.accepts_images:
            raise UserInputError(
                f"{calib}: image calibration needs a vision-language model; {adapter.family} is text-only"
            )
        processor = image_processor_for(model_dir, adapter.config.get("vision_config", {}))
        return vision_batches(items, tokenizer, processor, **adapter.vision_token_ids())
    stream = tokenize_documents(load_documents(calib, default_part="calib"), tokenizer)
    windows = sampled_windows(stream, seq_len, calib_tokens, seed)
    if adapter.encoder_output_norm is not None:
        batches, tags = seq2seq_batches(windows.input_ids, windows.tags, tokenizer, adapter.config, batch_size, seed)
        return batches, tags, windows.tag_names
    batches = [{"input_ids": ids} for ids, _ in windows.batches(batch_size)]
    return batches, windows.tags.reshape(-1), windows.tag_names
