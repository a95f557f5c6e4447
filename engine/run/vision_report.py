"""Measuring a vision-language run's before/after columns, and :func:`score`, which asks a model the held-out images'
questions.

The base model (adapter off) and each of the run's adapters are scored on the run's own held-out image examples (the
split it made, with its seed): the mean loss per learned token, and the exact match and token F1 of greedy replies
to each held-out image's question; the forgetting check reads the general English text through the language model.
engine.run.report words the columns as it does a text run's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import RunConfig
from engine.model.load import pick_dtype
from engine.run.short_answers import exact_match, token_f1
from engine.run.vision_loop import loss_sum
from engine.run.vision_session import encoded_held_out
from engine.vision.chat import adapter_state, answer
from engine.vision.data import VisionExample
from engine.vision.encode import EncodedExample
from engine.vision.families import VisionFamily
from engine.vision.images import load_image
from engine.vision.model import load_processor, load_vision_model


@dataclass(frozen=True)
class ImageScore:
    """How a model answered held-out image examples."""

    examples: int
    exact_match: float
    token_f1: float
    answers: tuple[str, ...]


def score(
    model: Any, processor: Any, examples: Sequence[VisionExample], max_pixels: int, tuned: bool = True
) -> ImageScore:
    """Exact match and token F1 of the model's replies to held-out examples (means over them)."""
    replies = []
    with adapter_state(model, tuned):
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


@dataclass(frozen=True)
class VisionColumn:
    """One model's figures on the held-out image examples and the general text."""

    label: str
    held_out_loss: float | None
    general_loss: float
    exact_match: float | None
    token_f1: float | None


@dataclass(frozen=True)
class VisionMeasurement:
    held_out_examples: int
    held_out_tokens: int
    general_tokens: int
    columns: list[VisionColumn]


def measure_columns(
    config: RunConfig,
    family: VisionFamily,
    adapters: Sequence[tuple[str, Path]],
    device: torch.device,
    general_text: Callable[[Any], Sequence[Any]],
    check: Callable[[], None],
) -> VisionMeasurement:
    """The base model's column and one per ``(label, adapter folder)``; ``general_text(tokenizer)`` gives the
    forgetting check's windows, ``check()`` is called between models (it raises to stop)."""
    from peft import PeftModel

    model_config = config.model if device.type == "cuda" else dataclasses.replace(config.model, qlora=False)
    processor = load_processor(model_config)
    budget = config.vision.max_pixels or family.max_pixels
    encoded = encoded_held_out(processor, config, budget)
    examples = [item.example for item in encoded]
    base = load_vision_model(model_config, family, device, pick_dtype(model_config.dtype, device))
    check()
    general = general_text(processor.tokenizer)
    names = [f"adapter_{i}" for i in range(len(adapters))]
    model = PeftModel.from_pretrained(base, str(adapters[0][1]), adapter_name=names[0])
    for name, (_, folder) in zip(names[1:], adapters[1:], strict=True):
        model.load_adapter(str(folder), adapter_name=name)
    model.eval()
    columns = [_column(model, processor, "base model", encoded, examples, general, budget, device, False)]
    for name, (label, _) in zip(names, adapters, strict=True):
        check()
        model.set_adapter(name)
        columns.append(_column(model, processor, label, encoded, examples, general, budget, device, True))
    tokens = sum(len(item) for item in encoded)
    return VisionMeasurement(len(encoded), tokens, sum(len(g) for g in general), columns)


def _column(
    model: Any,
    processor: Any,
    label: str,
    encoded: Sequence[EncodedExample],
    examples: Sequence[VisionExample],
    general: Sequence[Any],
    budget: int,
    device: torch.device,
    tuned: bool,
) -> VisionColumn:
    with torch.no_grad(), model.disable_adapter() if not tuned else contextlib.nullcontext():
        loss = _mean_loss(model, processor, encoded, budget, device) if encoded else None
        general_loss = _general_loss(model, general, device)
    answers = score(model, processor, examples, budget, tuned=tuned) if examples else None
    return VisionColumn(
        label, loss, general_loss, answers.exact_match if answers else None, answers.token_f1 if answers else None
    )


def _mean_loss(
    model: Any, processor: Any, encoded: Sequence[EncodedExample], budget: int, device: torch.device
) -> float:
    total, count = 0.0, 0
    for item in encoded:  # one at a time: a report must not run out of memory where training did not
        loss, tokens = loss_sum(model, processor, [item], budget, device)
        total, count = total + float(loss), count + tokens
    return total / max(1, count)


def _general_loss(model: Any, general: Sequence[Any], device: torch.device) -> float:
    """The mean loss per token of the general text, through the language model (text only, no image)."""
    total, count = 0.0, 0
    for window in general:
        ids = torch.tensor([window.input_ids], device=device)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return total / max(1, count)
