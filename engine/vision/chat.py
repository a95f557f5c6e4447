"""Answering from a picture and a prompt, with the base model or a tuned adapter, and scoring held-out examples.

:func:`answer` greedily generates the assistant's reply to one image and prompt; :func:`ask_about_image` is the
Chat page's question about a picture file. Generation runs with the adapter on or off (``tuned``), so one model in
memory answers both sides; the report scores held-out image examples with them (engine.run.vision_report).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.vision.encode import render
from engine.vision.images import ImageRef, load_image


def answer(
    model: Any, processor: Any, messages: Sequence[dict[str, Any]], images: Sequence[Any], max_new_tokens: int = 32
) -> str:
    """The model's greedy reply to ``messages`` (with ``{"type": "image"}`` parts) showing ``images``."""
    text = render(processor, messages, prompt=True)
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
    with adapter_state(model, tuned):
        return answer(model, processor, messages, [picture])


@contextlib.contextmanager
def adapter_state(model: Any, tuned: bool) -> Iterator[None]:
    """The adapter on (``tuned``) or switched off for the base model's answers; eval mode either way."""
    was_training = model.training
    model.eval()
    off = not tuned and hasattr(model, "disable_adapter")
    try:
        with model.disable_adapter() if off else contextlib.nullcontext():
            yield
    finally:
        model.train(was_training)
