"""Answering from a picture and a prompt, with the base model or a tuned adapter, and scoring held-out examples.

:func:`answer` greedily generates the assistant's reply to one image and prompt; :func:`ask_about_image` is the
Chat page's question about a picture file. Generation runs with the adapter on or off (``tuned``), so one model in
memory answers both sides; the report scores held-out image examples with them (engine.run.vision_report).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.model.adapter import RunAdapter
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


@dataclass
class ImageChat:
    """A vision-language run's base model with its adapter, to ask about pictures as the tuned or the base model."""

    model: Any
    processor: Any
    label: str
    max_pixels: int
    adapter: RunAdapter
    device: torch.device


def load_image_chat(run_folder: str | Path, device: str = "auto", which: str = "best") -> ImageChat:
    """The run's base model (from its config.json) with its ``which`` adapter (best or last) loaded, in eval mode."""
    import dataclasses

    from peft import PeftModel

    from engine.config import RunConfig
    from engine.errors import TuneDeckError
    from engine.model.adapter import run_adapter
    from engine.model.load import pick_device, pick_dtype
    from engine.vision.model import load_processor, load_vision_model, vision_family

    folder = Path(run_folder)
    chosen = run_adapter(folder, which)
    config = RunConfig.load(folder / "config.json")
    family = vision_family(config.model)
    if chosen is None or family is None:
        raise TuneDeckError(f"{folder} has no finished adapter of a vision-language model to ask about a picture")
    torch_device = pick_device(device)
    model_config = config.model if torch_device.type == "cuda" else dataclasses.replace(config.model, qlora=False)
    base = load_vision_model(model_config, family, torch_device, pick_dtype(model_config.dtype, torch_device))
    base.config.use_cache = True  # training turned the KV cache off; generation wants it
    model = PeftModel.from_pretrained(base, str(chosen.folder))
    model.eval()
    budget = config.vision.max_pixels or family.max_pixels
    return ImageChat(model, load_processor(model_config), folder.name, budget, chosen, torch_device)


def ask(chat: ImageChat, prompt: str, image: str | Path | None, tuned: bool = True, max_new_tokens: int = 256) -> str:
    """The tuned (or base) model's greedy reply to ``prompt``, about the picture in ``image`` where one is given."""
    pictures = [load_image(ImageRef(Path(image), str(image), 1, str(image)), chat.max_pixels)] if image else []
    content = [*([{"type": "image"}] if pictures else []), {"type": "text", "text": prompt}]
    with adapter_state(chat.model, tuned):
        return answer(chat.model, chat.processor, [{"role": "user", "content": content}], pictures, max_new_tokens)
