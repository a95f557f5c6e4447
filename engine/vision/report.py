"""The before/after report of a vision-language run, in the shape of a text run's (engine.run.report).

The base model (adapter off) and the run's adapters (the best by held-out loss, and the last) are scored on the
run's own held-out image examples (the split it made, with its seed): the mean loss per learned token and its
perplexity, and the exact match and token F1 of greedy replies to each held-out image's question. The forgetting
check reads the same general English text as for text runs, through the language model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.model.load import pick_device, pick_dtype
from engine.run.folder import load_run_config
from engine.run.report import (
    WINDOW,
    Cancelled,
    ModelScores,
    RunReport,
    _check,
    _columns,
    _label,
    _last_step,
    general_examples,
    never,
)
from engine.vision.chat import score
from engine.vision.data import VisionExample
from engine.vision.encode import EncodedExample
from engine.vision.families import VisionFamily
from engine.vision.model import load_processor, load_vision_model
from engine.vision.run import loss_sum
from engine.vision.session import encoded_held_out


def build_vision_report(
    run_dir: Path, family: VisionFamily, device: str | None = None, cancelled: Cancelled = never
) -> RunReport:
    """Score the base model and the run's adapters on the held-out image examples and the general text."""
    from peft import PeftModel

    config = load_run_config(run_dir)
    last_step = _last_step(run_dir)
    adapters = _columns(run_dir, last_step)
    torch_device = pick_device(device or config.training.device)
    model_config = config.model if torch_device.type == "cuda" else dataclasses.replace(config.model, qlora=False)
    processor = load_processor(model_config)
    budget = config.vision.max_pixels or family.max_pixels
    encoded = encoded_held_out(processor, config, budget)
    kept = [item.example for item in encoded]
    base = load_vision_model(model_config, family, torch_device, pick_dtype(model_config.dtype, torch_device))
    _check(cancelled)
    general = general_examples(processor.tokenizer, WINDOW)
    names = [f"adapter_{i}" for i in range(len(adapters))]
    model = PeftModel.from_pretrained(base, str(adapters[0].folder), adapter_name=names[0])
    for name, adapter in zip(names[1:], adapters[1:], strict=True):
        model.load_adapter(str(adapter.folder), adapter_name=name)
    model.eval()
    columns = [_column(model, processor, "base model", encoded, kept, general, budget, torch_device, False)]
    for name, adapter in zip(names, adapters, strict=True):
        _check(cancelled)
        model.set_adapter(name)
        label = _label(adapter, last_step)
        columns.append(_column(model, processor, label, encoded, kept, general, budget, torch_device, True))
    note = "greedy replies to each held-out image's question" if kept else "no held-out image examples"
    return RunReport(
        run_dir.name, "sft", len(encoded), sum(len(item) for item in encoded), sum(len(g) for g in general),
        columns, len(kept), note,
    )  # fmt: skip


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
) -> ModelScores:
    with torch.no_grad(), model.disable_adapter() if not tuned else contextlib.nullcontext():
        loss = _mean_loss(model, processor, encoded, budget, device) if encoded else None
        general_loss = _general_loss(model, general, device)
    answers = score(model, processor, examples, budget, tuned=tuned) if examples else None
    return ModelScores(
        label=label,
        held_out_loss=loss,
        held_out_perplexity=math.exp(min(loss, 50.0)) if loss is not None else None,
        reward_accuracy=None,
        general_perplexity=math.exp(min(general_loss, 50.0)),
        exact_match=answers.exact_match if answers else None,
        token_f1=answers.token_f1 if answers else None,
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
