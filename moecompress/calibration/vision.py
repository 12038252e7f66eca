"""Image+caption calibration for vision-language MoE models, with every token tagged ``vision`` or ``text``.

Sources:
- ``builtin:shapes[:N]``: N procedurally drawn images of coloured shapes on plain backgrounds with captions
  naming them (large uniform regions: many vision tokens carry little information).
- ``builtin:stripes[:N]``: N striped textures with captions, a second, differently distributed set.
- ``hf:NAME[:CONFIG][:SPLIT]`` for a dataset with an ``image`` column and a ``caption`` or ``text`` column.
Nothing is downloaded for the built-in sets; they are drawn from a seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import UserInputError

BUILTIN_IMAGE_SOURCES = ("shapes", "stripes")
_COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 220, 50),
    "purple": (140, 60, 180),
    "orange": (240, 140, 30),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "grey": (128, 128, 128),
}
_SHAPES = ("circle", "square", "triangle")


@dataclass(frozen=True)
class ImageCaption:
    image: np.ndarray  # [H, W, 3] uint8
    caption: str
    id: str


def _draw_shapes(rng: np.random.Generator, size: int, index: int) -> ImageCaption:
    names = list(_COLOURS)
    background, colour = rng.choice(len(names), 2, replace=False)
    shape = _SHAPES[rng.integers(len(_SHAPES))]
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = _COLOURS[names[background]]
    radius = int(rng.integers(size // 8, size // 3))
    cy, cx = (int(v) for v in rng.integers(radius, size - radius, 2))
    yy, xx = np.mgrid[:size, :size]
    if shape == "circle":
        mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= radius**2
    elif shape == "square":
        mask = (abs(yy - cy) <= radius) & (abs(xx - cx) <= radius)
    else:
        mask = (yy >= cy - radius) & (yy <= cy + radius) & (abs(xx - cx) <= (yy - (cy - radius)) / 2)
    image[mask] = _COLOURS[names[colour]]
    where = ("top" if cy < size / 2 else "bottom") + (" left" if cx < size / 2 else " right")
    caption = f"A {names[colour]} {shape} in the {where} of a {names[background]} picture."
    return ImageCaption(image=image, caption=caption, id=f"shapes/{index}")


def _draw_stripes(rng: np.random.Generator, size: int, index: int) -> ImageCaption:
    names = list(_COLOURS)
    first, second = rng.choice(len(names), 2, replace=False)
    width = int(rng.integers(2, max(3, size // 4)))
    vertical = bool(rng.integers(2))
    coordinate = np.arange(size)[None, :] if vertical else np.arange(size)[:, None]
    bands = (coordinate // width) % 2 == 0
    bands = np.broadcast_to(bands, (size, size))
    image = np.where(bands[..., None], np.array(_COLOURS[names[first]]), np.array(_COLOURS[names[second]]))
    caption = f"{names[first].capitalize()} and {names[second]} {'vertical' if vertical else 'horizontal'} stripes."
    return ImageCaption(image=image.astype(np.uint8), caption=caption, id=f"stripes/{index}")


def builtin_image_captions(name: str, count: int = 64, seed: int = 0, size: int = 64) -> list[ImageCaption]:
    draw = {"shapes": _draw_shapes, "stripes": _draw_stripes}.get(name)
    if draw is None:
        raise UserInputError(f"unknown built-in image source {name!r}; choose from {', '.join(BUILTIN_IMAGE_SOURCES)}")
    rng = np.random.default_rng(seed)
    return [draw(rng, size, i) for i in range(count)]


def _datasets():
    import datasets

    return datasets


def _hf_dataset(spec: str):
    """The dataset an ``hf:`` spec names, or None if it cannot be loaded (the text path reports why)."""
    from .sources import parse_hf_spec

    name, config, split = parse_hf_spec(spec)
    try:
        return _datasets().load_dataset(name, config, split=split)
    except Exception:
        return None


def load_image_captions(spec: str, *, seed: int = 0, size: int = 64, count: int = 64) -> list[ImageCaption] | None:
    """The image+caption items ``spec`` names, or None when it is not an image source (text goes elsewhere).

    An ``hf:`` dataset is loaded once and counts as an image source when it has an ``Image`` column.
    """
    if spec.startswith("builtin:"):
        pieces = spec.split(":")
        if pieces[1] not in BUILTIN_IMAGE_SOURCES:
            return None
        return builtin_image_captions(pieces[1], int(pieces[2]) if len(pieces) > 2 else count, seed, size)
    if not spec.startswith("hf:"):
        return None
    dataset = _hf_dataset(spec)
    if dataset is None or not any(isinstance(f, _datasets().Image) for f in dataset.features.values()):
        return None
    caption_column = next((c for c in ("caption", "text") if c in dataset.column_names), None)
    if "image" not in dataset.column_names or caption_column is None:
        raise UserInputError(f"{spec}: needs an 'image' column and a 'caption' or 'text' column")
    return [
        ImageCaption(
            image=np.asarray(row["image"].convert("RGB").resize((size, size))),
            caption=str(row[caption_column]),
            id=f"{spec}:{i}",
        )
        for i, row in enumerate(dataset)
    ]


def image_processor_for(model_dir: Path, vision_config: dict):
    """The Qwen2-VL-style image processor (PIL backend), from the model's preprocessor config if it has one."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if (Path(model_dir) / "preprocessor_config.json").is_file():
        return Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    patch = int(vision_config.get("patch_size", 16))
    merge = int(vision_config.get("spatial_merge_size", 2))
    return Qwen2VLImageProcessorPil(
        patch_size=patch,
        merge_size=merge,
        temporal_patch_size=int(vision_config.get("temporal_patch_size", 2)),
        min_pixels=(patch * merge) ** 2,
        max_pixels=(patch * merge * 32) ** 2,
    )


def vision_batches(
    items: list[ImageCaption],
    tokenizer,
    processor,
    *,
    image_token_id: int,
    vision_start_id: int,
    vision_end_id: int,
    merge_size: int,
) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor, list[str]]:
    """One model-input batch per image+caption: ``<vision_start> <image>*n <vision_end> caption``.

    Returns the batches, the flat tag index of every token in batch order, and the tag names.
    """
    tag_names = ["text", "vision"]
    batches, tags = [], []
    for item in items:
        pixels = processor(images=[item.image], return_tensors="pt")
        grid = pixels["image_grid_thw"]
        image_tokens = int(grid.prod()) // merge_size**2
        caption = tokenizer(" " + item.caption, add_special_tokens=False)["input_ids"]
        ids = torch.tensor(
            [[vision_start_id] + [image_token_id] * image_tokens + [vision_end_id] + caption], device="cpu"
        )
        is_image = ids == image_token_id
        batches.append(
            {
                "input_ids": ids,
                "pixel_values": pixels["pixel_values"],
                "image_grid_thw": grid,
                "mm_token_type_ids": is_image.long(),
            }
        )
        tags.append(is_image.long().reshape(-1))
    return batches, torch.cat(tags), tag_names
