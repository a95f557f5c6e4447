"""Starting a vision-language run: its examples encoded, its model with LoRA on the language model, its optimizer.

Every image is opened and decoded before the model loads (a bad one stops the run naming file, row and image).
Examples become micro-batches of similar length, padded to the longest, of at most ``data.tokens_per_batch``
padded tokens; each epoch visits them in a fresh seeded order, so resuming is exact, as for text runs.
"""

from __future__ import annotations

import random
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import RunConfig, held_out_count
from engine.data.prepare import RowSchedule
from engine.errors import ConfigError, DataError
from engine.events import Event, Notice
from engine.model.load import count_parameters, pick_device, pick_dtype
from engine.run.best import EvalWatch
from engine.run.optimizer import adamw
from engine.run.schedule import lr_lambda
from engine.vision.data import VisionExample, load_vision_examples
from engine.vision.encode import EncodedExample, check_images, encode
from engine.vision.families import VisionFamily
from engine.vision.model import load_processor, load_vision_model, with_lora
from engine.vision.speed import speed_notes

AUTOMATIC_TOKENS = 4096
"""``data.max_seq_len`` and ``data.tokens_per_batch`` when left automatic (0): image tokens make rows long, and an
image cannot be cut, so examples up to this length are kept and padded micro-batches hold up to this many tokens."""


@dataclass
class VisionSession:
    """Everything a vision-language run holds while it trains."""

    config: RunConfig
    run_dir: Path
    device: torch.device
    family: VisionFamily
    processor: Any
    model: Any
    train: list[EncodedExample]
    eval: list[EncodedExample]
    rows: list[list[int]]
    """Micro-batches: indices into ``train`` of examples padded together."""
    eval_rows: list[list[int]]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    total_steps: int
    max_pixels: int
    step: int = 0
    micro_batches: int = 0
    last_loss: float | None = None
    last_eval: float | None = None
    schedule: RowSchedule = field(init=False)
    eval_watch: EvalWatch = field(init=False)

    def __post_init__(self) -> None:
        self.schedule = RowSchedule(len(self.rows), self.config.training.seed)
        self.eval_watch = EvalWatch(self.config.training.early_stop or 0)

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def start_vision(config: RunConfig, run_dir: Path, family: VisionFamily) -> Generator[Event, None, VisionSession]:
    """Check the images, encode the examples, load the model with a fresh adapter and build the optimizer."""
    random.seed(config.training.seed)
    torch.manual_seed(config.training.seed)
    device = pick_device(config.training.device)
    dtype = pick_dtype(config.model.dtype, device)
    if config.training.method != "sft":
        raise ConfigError(f"{config.training.method} is not available for vision-language models", hint="use sft")
    train_raw, eval_raw = _examples(config)
    pictures = check_images([*train_raw, *eval_raw])
    processor = load_processor(config.model)
    budget = config.vision.max_pixels or family.max_pixels
    max_len = config.data.max_seq_len or AUTOMATIC_TOKENS
    train, dropped = _encoded(processor, train_raw, budget, max_len)
    evaluation, _ = _encoded(processor, eval_raw, budget, max_len)
    if not train:
        raise DataError("no usable training examples are left after tokenization", path=config.data.path)
    yield Notice(f"{family.label}: {pictures} images checked, each scaled to at most {budget:,} pixels")
    if dropped:
        yield Notice(f"{dropped} example(s) longer than {max_len} tokens (images included) were dropped")
    yield Notice(
        "rows are padded, not packed: an example's image tokens must not meet another example's, and the image "
        "attention masks are built per example"
    )
    for note in speed_notes(config.speed, device):
        yield Notice(note)
    model = with_lora(load_vision_model(config.model, family, device, dtype), family, config, device)
    return _session(config, run_dir, device, family, processor, model, train, evaluation, budget)


def _session(
    config: RunConfig,
    run_dir: Path,
    device: torch.device,
    family: VisionFamily,
    processor: Any,
    model: Any,
    train: list[EncodedExample],
    evaluation: list[EncodedExample],
    budget: int,
) -> VisionSession:
    tokens_per_batch = config.data.tokens_per_batch or AUTOMATIC_TOKENS
    rows = padded_rows(train, tokens_per_batch)
    training = config.training
    optimizer = adamw(
        [p for p in model.parameters() if p.requires_grad], training.learning_rate, training.weight_decay,
        training.optimizer, device,
    )  # fmt: skip
    total_steps = training.max_steps or max(1, -(-max(1.0, training.epochs) * len(rows) // training.grad_accum))
    total_steps = int(total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(training.schedule, training.warmup_steps or 0, total_steps)
    )
    return VisionSession(
        config, run_dir, device, family, processor, model, train, evaluation, rows,
        padded_rows(evaluation, tokens_per_batch), optimizer, scheduler, total_steps, budget,
    )  # fmt: skip


def _examples(config: RunConfig) -> tuple[list[VisionExample], list[VisionExample]]:
    if not config.data.path:
        raise DataError("no dataset given", hint="pass --data PATH (chat rows with image parts, or a folder of images)")
    examples = load_vision_examples(config.data.path)
    if config.data.eval_path:
        return examples, load_vision_examples(config.data.eval_path)
    fraction = config.data.eval_fraction
    count = held_out_count(len(examples)) if fraction is None else max(1, round(len(examples) * fraction))
    if (fraction is not None and fraction <= 0) or len(examples) < 2 or count == 0:
        return examples, []
    order = list(range(len(examples)))
    random.Random(config.training.seed).shuffle(order)
    held = set(order[:count])
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def _encoded(
    processor: Any, examples: Sequence[VisionExample], budget: int, max_len: int
) -> tuple[list[EncodedExample], int]:
    """The examples that fit ``max_len`` tokens, and how many did not (an image cannot be cut in half)."""
    encoded = [encode(processor, example, budget) for example in examples]
    kept = [item for item in encoded if len(item) <= max_len and item.trained_tokens > 0]
    return kept, len(encoded) - len(kept)


def padded_rows(examples: Sequence[EncodedExample], budget: int) -> list[list[int]]:
    """Micro-batches of examples of similar length whose padded size (longest x count) stays within ``budget``."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]))
    rows: list[list[int]] = []
    for index in order:
        longest = len(examples[index])  # sorted: the newest is the longest
        if rows and longest * (len(rows[-1]) + 1) <= budget:
            rows[-1].append(index)
        else:
            rows.append([index])
    return rows


def padding_efficiency(examples: Sequence[EncodedExample], rows: Sequence[Sequence[int]]) -> float:
    """Real tokens over padded tokens."""
    real = sum(len(examples[i]) for row in rows for i in row)
    padded = sum(max(len(examples[i]) for i in row) * len(row) for row in rows)
    return real / padded if padded else 1.0


def parameter_counts(session: VisionSession) -> tuple[int, int]:
    return count_parameters(session.model)
