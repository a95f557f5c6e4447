"""What an image dataset holds before a run with a vision-language model: the Dataset page's report.

The same reading, image checks and encoding as training (engine.vision.data, engine.vision.images,
engine.vision.encode), but a bad image is listed with its row instead of stopping the report at the first. Each
example's image tokens are counted, and in the preview an image's tokens are one piece ("[image: 256 tokens]")
beside the text, whose learned part is highlighted; the previewed examples' pictures come with it as thumbnails.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ModelConfig
from engine.data.packing import IGNORE_INDEX
from engine.errors import DataError
from engine.run.vision_session import padded_rows, padding_efficiency
from engine.vision.data import VisionExample, load_vision_examples
from engine.vision.encode import EncodedExample, encode, image_token_ids
from engine.vision.families import VisionFamily
from engine.vision.images import check_image
from engine.vision.model import load_processor
from engine.vision.recipe import AUTOMATIC_TOKENS

IMAGE_FORMAT = "chat rows with images"
FOLDER_FORMAT = "images with captions"


@dataclass(frozen=True)
class ImageDataFigures:
    """What the Dataset page shows of an image dataset (engine.run.data_report words it as a DatasetReport)."""

    data_format: str
    rows: int
    good_rows: int
    problems: list[tuple[int, str, str]]
    encoded: list[EncodedExample]
    sampled: bool
    padded_rows: int
    padding_efficiency: float
    tokens_per_batch: int
    preview: list[list[tuple[str, bool]]]
    images: int
    thumbnails: list[list[str]]


def image_data_figures(
    path: str, model_name: str, family: VisionFamily, tokens_per_batch: int, limit: int, previews: int
) -> ImageDataFigures:
    """Read ``path``, check its images and encode (up to ``limit`` of) its examples as a run with ``model_name``
    would; ``previews`` examples are previewed."""
    examples = load_vision_examples(path)
    problems = [problem for example in examples for problem in _image_problems(example)]
    bad = {row for row, _, _ in problems}
    good = [example for example in examples if example.row not in bad]
    processor = load_processor(ModelConfig(name=model_name))
    encoded = [encode(processor, example, family.max_pixels) for example in good[:limit]]
    budget = max(tokens_per_batch or AUTOMATIC_TOKENS, max((len(item) for item in encoded), default=0))
    rows = padded_rows(encoded, budget)
    image_ids = image_token_ids(processor)
    return ImageDataFigures(
        data_format=FOLDER_FORMAT if Path(path).is_dir() else IMAGE_FORMAT,
        rows=len(examples),
        good_rows=len(good),
        problems=problems,
        encoded=encoded,
        sampled=len(good) > limit,
        padded_rows=len(rows),
        padding_efficiency=padding_efficiency(encoded, rows),
        tokens_per_batch=budget,
        preview=[image_pieces(processor.tokenizer, item, image_ids) for item in encoded[:previews]],
        images=sum(len(example.images) for example in good),
        thumbnails=[[str(ref.path) for ref in item.example.images] for item in encoded[:previews]],
    )


def _image_problems(example: VisionExample) -> list[tuple[int, str, str]]:
    """(row, "image", message) for each image of the example that cannot be used."""
    problems = []
    for ref in example.images:
        try:
            check_image(ref)
        except DataError as err:
            problems.append((example.row, "image", err.message.split(": ", 1)[-1]))  # without "file F, row R"
    return problems


def image_pieces(tokenizer: Any, item: EncodedExample, image_ids: frozenset[int]) -> list[tuple[str, bool]]:
    """The example as (text, learned?) pieces, each run of image tokens one "[image: N tokens]" piece."""
    pieces: list[tuple[str, bool]] = []
    run = 0
    for token, label in zip(item.input_ids, item.labels, strict=True):
        if token in image_ids:
            run += 1
            continue
        if run:
            pieces.append((f"[image: {run} tokens]", False))
            run = 0
        text, learned = str(tokenizer.decode([token])), label != IGNORE_INDEX
        if pieces and pieces[-1][1] == learned and not pieces[-1][0].startswith("[image:"):
            pieces[-1] = (pieces[-1][0] + text, learned)
        else:
            pieces.append((text, learned))
    if run:
        pieces.append((f"[image: {run} tokens]", False))
    return pieces
