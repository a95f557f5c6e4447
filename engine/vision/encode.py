"""From an image-and-text example to tokens, labels and pixels, and from examples to a padded batch.

The processor renders the conversation with its chat template and replaces each image placeholder with the image's
tokens. Which tokens are learned comes from rendering the conversation up to each assistant turn: the tokens
between the prompt before an answer and the end of that answer (its end-of-turn marker included) are learned,
everything else (system and user text, image tokens, template markup) has label -100. Rows are padded, never packed:
the image tokens of one example must not meet another example's attention, and the families' image-attention masks
(Gemma 3's bidirectional image blocks, Mllama's cross-attention) are built per row by the processors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.data.packing import IGNORE_INDEX
from engine.errors import DataError
from engine.vision.data import VisionExample
from engine.vision.images import ImageCache, check_image, load_image


@dataclass(frozen=True)
class EncodedExample:
    """An example as the model sees it: the rendered text, its tokens and labels, and how many are image tokens."""

    example: VisionExample
    text: str
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    image_tokens: int

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def trained_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels[1:])


def check_images(examples: Sequence[VisionExample]) -> int:
    """Open and decode every image before training (errors name file, row and image); returns how many there are."""
    for example in examples:
        for ref in example.images:
            check_image(ref)
    return sum(len(example.images) for example in examples)


def encode(processor: Any, example: VisionExample, max_pixels: int) -> EncodedExample:
    """The example's tokens and labels; only its assistant turns are learned."""
    images = [load_image(ref, max_pixels) for ref in example.images]
    text = render(processor, example.messages, prompt=False)
    ids = _token_ids(processor, text, images)
    labels = [IGNORE_INDEX] * len(ids)
    for turn, message in enumerate(example.messages):
        if message["role"] != "assistant":
            continue
        before = example.images_before(turn)
        start = len(_token_ids(processor, render(processor, example.messages[:turn], prompt=True), images[:before]))
        end = len(_token_ids(processor, render(processor, example.messages[: turn + 1], prompt=False), images[:before]))
        labels[start:end] = ids[start:end]
    image_ids = image_token_ids(processor)
    labels = [IGNORE_INDEX if token in image_ids else label for token, label in zip(ids, labels, strict=True)]
    image_tokens = sum(token in image_ids for token in ids)
    return EncodedExample(example, text, tuple(ids), tuple(labels), image_tokens)


def render(processor: Any, messages: Sequence[dict[str, Any]], prompt: bool) -> str:
    """The conversation through the processor's chat template (``prompt``: ending with the assistant's turn opened),
    as text; the tokenizer renders it, since some processors' own rendering asks for their video processor."""
    template = getattr(processor, "chat_template", None)
    rendered = processor.tokenizer.apply_chat_template(
        list(messages), chat_template=template, tokenize=False, add_generation_prompt=prompt
    )
    return str(rendered)


def _token_ids(processor: Any, text: str, images: list[Any]) -> list[int]:
    out = processor(text=[text], images=[images] if images else None, add_special_tokens=False)
    return [int(token) for token in out["input_ids"][0]]


def image_token_ids(processor: Any) -> frozenset[int]:
    """The ids of the tokens that stand for image content (placeholders, tile markers): never learned."""
    tokenizer = processor.tokenizer
    names = [getattr(processor, attr, None) for attr in ("image_token", "boi_token", "fake_image_token")]
    names += [getattr(tokenizer, attr, None) for attr in ("image_token", "boi_token", "eoi_token")]
    names += ["<|vision_start|>", "<|vision_end|>", "<global-img>"]
    ids = {getattr(processor, "image_token_id", None)}
    ids |= {tokenizer.convert_tokens_to_ids(name) for name in names if isinstance(name, str)}
    unknown = tokenizer.unk_token_id
    return frozenset(i for i in ids if isinstance(i, int) and i != unknown and i >= 0)


def batch(
    processor: Any, encoded: Sequence[EncodedExample], max_pixels: int, cache: ImageCache | None = None
) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for ``encoded`` padded to one length, with ``labels`` (-100 on padding);
    pictures come from ``cache`` where one is given."""
    load = cache.load if cache is not None else lambda ref: load_image(ref, max_pixels)
    images = [[load(ref) for ref in item.example.images] for item in encoded]
    out = processor(
        text=[item.text for item in encoded],
        images=images if any(images) else None,
        padding=True,
        add_special_tokens=False,
        return_tensors="pt",
    )
    inputs = {key: value for key, value in out.items() if isinstance(value, torch.Tensor)}
    labels = torch.full_like(inputs["input_ids"], IGNORE_INDEX)
    for row, item in enumerate(encoded):
        length = len(item)
        if inputs["input_ids"][row, :length].tolist() != list(item.input_ids):
            raise DataError(
                "the processor gives this example different tokens in a batch than alone",
                path=item.example.data_file,
                row=item.example.row,
            )
        labels[row, :length] = torch.tensor(item.labels)
    inputs["labels"] = labels
    return inputs
