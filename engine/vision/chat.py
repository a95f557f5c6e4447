"""Answering from a picture and a prompt, with the base model or a tuned adapter, and scoring held-out examples.

:func:`answer` greedily generates the assistant's reply to one image and prompt. :func:`score` asks the model each
held-out example's question about its image and compares the reply with the expected answer as the text report
does (:mod:`engine.run.short_answers`: exact match and token F1 after normalising case, punctuation and articles).
Generation runs with the adapter on or off (``tuned``), so one model in memory answers both sides.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.run.short_answers import exact_match, token_f1
from engine.vision.data import VisionExample
from engine.vision.images import ImageRef, load_image


@dataclass(frozen=True)
class ImageScore:
    """How a model answered held-out image examples."""

    examples: int
    exact_match: float
    token_f1: float
    answers: tuple[str, ...]


def answer(
    model: Any, processor: Any, messages: Sequence[dict[str, Any]], images: Sequence[Any], max_new_tokens: int = 32
) -> str:
    """The model's greedy reply to ``messages`` (with ``{"type": "image"}`` parts) showing ``images``."""
    text = processor.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    inputs = processor(
        text=[text], images=[list(images)] if images else None, add_special_tokens=False, return_tensors="pt"
    )
    device = next(model.parameters()).device
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    inputs = {k: v.to(device, dtype=dtype if v.is_floating_point() else None) for k, v in inputs.items()}
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=processor.tokenizer.pad_token_id,
            eos_token_id=processor.tokenizer.eos_token_id,
        )
    reply = out[0, inputs["input_ids"].shape[1] :]
    return str(processor.tokenizer.decode(reply, skip_special_tokens=True)).strip()


def ask_about_image(
    model: Any, processor: Any, image: str | Path, prompt: str, max_pixels: int, tuned: bool = True
) -> str:
    """The reply to ``prompt`` about the picture in ``image`` (a Chat question), with or without the adapter."""
    picture = load_image(ImageRef(Path(image), str(image), 1, str(image)), max_pixels)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    with _adapter(model, tuned):
        return answer(model, processor, messages, [picture])


def score(
    model: Any, processor: Any, examples: Sequence[VisionExample], max_pixels: int, tuned: bool = True
) -> ImageScore:
    """Exact match and token F1 of the model's replies to held-out examples (means over them)."""
    replies = []
    with _adapter(model, tuned):
        for example in examples:
            images = [load_image(ref, max_pixels) for ref in example.images]
            replies.append(answer(model, processor, example.prompt, images))
    n = max(1, len(examples))
    return ImageScore(
        examples=len(examples),
        exact_match=sum(exact_match(r, e.answer) for r, e in zip(replies, examples, strict=True)) / n,
        token_f1=sum(token_f1(r, e.answer) for r, e in zip(replies, examples, strict=True)) / n,
        answers=tuple(replies),
    )


@contextlib.contextmanager
def _adapter(model: Any, tuned: bool) -> Iterator[None]:
    """The adapter on (``tuned``) or switched off for the base model's answers; eval mode either way."""
    was_training = model.training
    model.eval()
    off = not tuned and hasattr(model, "disable_adapter")
    try:
        with model.disable_adapter() if off else contextlib.nullcontext():
            yield
    finally:
        model.train(was_training)
