"""Starting a vision-language run: its examples encoded, its model with LoRA on the language model, its optimizer.

Every image is opened and decoded before the model loads (a bad one stops the run naming file, row and image).
Examples become micro-batches of similar length, padded to the longest, of at most ``data.tokens_per_batch``
padded tokens; each epoch visits them in a fresh seeded order, so resuming is exact, as for text runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import RunConfig, held_out_count
from engine.data.prepare import RowSchedule
from engine.errors import ConfigError, DataError
from engine.events import Event, Notice
from engine.hardware.fit_to_data import FitFacts, apply_fit, fit_to_data
from engine.method_facts import IMAGES, facts_for
from engine.model.load import count_parameters, pick_device, pick_dtype
from engine.run import checkpoint as ckpt
from engine.run import guard
from engine.run.best import EvalWatch
from engine.run.fit import has_automatic
from engine.run.folder import CONFIG_FILE
from engine.run.optimizer import adamw
from engine.run.rows import model_shape
from engine.run.schedule import lr_lambda
from engine.speed import reachable_device_memory
from engine.vision.data import VisionExample, load_vision_examples
from engine.vision.encode import EncodedExample, check_images, encode
from engine.vision.families import VisionFamily
from engine.vision.images import ImageCache
from engine.vision.model import load_processor, load_vision_model, model_config_dict, with_lora
from engine.vision.recipe import AUTOMATIC_TOKENS
from engine.vision.speed import Recompute, choose_recompute, speed_notes

if TYPE_CHECKING:
    from engine.hardware.planner import MemoryEstimate


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
    model_config: dict[str, Any] | None = None
    """The model's ``config.json`` (None where it cannot be read): what the memory planner sizes."""
    step: int = 0
    micro_batches: int = 0
    last_loss: float | None = None
    last_eval: float | None = None
    schedule: RowSchedule = field(init=False)
    eval_watch: EvalWatch = field(init=False)
    images: ImageCache = field(init=False)
    """The pictures fitted to the budget, kept for the epochs after the first."""
    tokens_per_batch: int = field(init=False)
    """Padded tokens a micro-batch may hold now: the rows' budget, lower while memory runs short."""
    recovery: guard.Recovery = field(init=False)
    """What out-of-memory steps lowered, and when to try it again (engine.run.vision_guard)."""

    def __post_init__(self) -> None:
        self.schedule = RowSchedule(len(self.rows), self.config.training.seed)
        self.eval_watch = EvalWatch(self.config.training.early_stop or 0)
        self.images = ImageCache(self.max_pixels)
        self.tokens_per_batch = self.config.data.tokens_per_batch or AUTOMATIC_TOKENS
        self.recovery = guard.Recovery(climb_after=guard.CLIMB_AFTER)

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def start_vision(
    config: RunConfig, run_dir: Path, family: VisionFamily, resuming: bool = False
) -> Generator[Event, None, VisionSession]:
    """Check the images, encode the examples, settle the automatic settings (a fresh run), load the model with a
    fresh adapter and build the optimizer."""
    random.seed(config.training.seed)
    torch.manual_seed(config.training.seed)
    device = pick_device(config.training.device)
    dtype = pick_dtype(config.model.dtype, device)
    refused = facts_for(config.training.method).refusals.get(IMAGES)
    if refused is not None:
        raise ConfigError(refused, hint="use --method sft")
    examples, separate = _read(config)
    pictures = check_images([*examples, *separate])
    processor = load_processor(config.model)
    budget = config.vision.max_pixels or family.max_pixels
    yield Notice(f"{family.label}: {pictures} images checked, each scaled to at most {budget:,} pixels")
    max_len = config.data.max_seq_len or AUTOMATIC_TOKENS
    encoded = [encode(processor, example, budget) for example in examples]
    if not resuming and has_automatic(config):
        config = yield from _fitted(config, encoded, run_dir)
    held = held_out_indices(len(examples), config) if not separate else set()
    train, dropped = _kept([e for i, e in enumerate(encoded) if i not in held], max_len)
    evaluation, _ = _kept(
        [encode(processor, e, budget) for e in separate] or [encoded[i] for i in sorted(held)], max_len
    )
    if not train:
        raise DataError("no usable training examples are left after tokenization", path=config.data.path)
    if dropped:
        yield Notice(f"{dropped} example(s) longer than {max_len} tokens (images included) were dropped")
    yield Notice(
        "rows are padded, not packed: an example's image tokens must not meet another example's, and the image "
        "attention masks are built per example"
    )
    model_config = model_config_dict(config.model)
    recompute = _recompute(config, model_config, family, train, budget, device, dtype)
    for note in speed_notes(config.speed, recompute):
        yield Notice(note)
    model = with_lora(load_vision_model(config.model, family, device, dtype), family, config, recompute.on)
    model.train()  # from_pretrained gives eval mode, where transformers skips the recompute (and dropout)
    session = _session(config, run_dir, device, family, processor, model, train, evaluation, budget)
    session.model_config = model_config
    return session


def _fitted(config: RunConfig, encoded: Sequence[EncodedExample], run_dir: Path) -> Generator[Event, None, RunConfig]:
    """``config`` with its automatic settings chosen for these examples (as for text runs: engine.hardware
    .fit_to_data), written into the run's config.json so that a resumed run trains the same steps."""
    shape = model_shape(config.model)
    facts = FitFacts(
        examples=len(encoded),
        tokens=sum(len(item) for item in encoded),
        separate_held_out=bool(config.data.eval_path),
        parameters=shape.total_params() if shape is not None else None,
        instruct=False,  # keeping knowledge replays text answers: not for image runs
        method="sft",
        tokens_per_batch=config.data.tokens_per_batch or AUTOMATIC_TOKENS,
        grad_accum=config.training.grad_accum,
    )
    resolved, lines = apply_fit(config, fit_to_data(facts))
    resolved = dataclasses.replace(resolved, training=dataclasses.replace(resolved.training, keep_knowledge=False))
    lines = [line for line in lines if not line.startswith("keep knowledge")]
    if config.training.keep_knowledge is None:
        lines.append("keep knowledge: off (it mixes in the base model's text answers; picture runs train without it)")
    if lines:
        yield Notice("automatic settings for this data (a flag sets any of them):\n  " + "\n  ".join(lines))
    if run_dir.is_dir():
        ckpt.write_text_atomic(run_dir / CONFIG_FILE, json.dumps(resolved.to_dict(), indent=2) + "\n")
    return resolved


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
    passes = training.epochs or 1.0
    total_steps = training.max_steps or max(1, math.ceil(passes * len(rows) / training.grad_accum))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(training.schedule, training.warmup_steps or 0, total_steps)
    )
    return VisionSession(
        config, run_dir, device, family, processor, model, train, evaluation, rows,
        padded_rows(evaluation, tokens_per_batch), optimizer, scheduler, total_steps, budget,
    )  # fmt: skip


def _read(config: RunConfig) -> tuple[list[VisionExample], list[VisionExample]]:
    """The data file's examples, and those of ``data.eval_path`` (empty without one)."""
    if not config.data.path:
        raise DataError("no dataset given", hint="pass --data PATH (chat rows with image parts, or a folder of images)")
    examples = load_vision_examples(config.data.path)
    return examples, load_vision_examples(config.data.eval_path) if config.data.eval_path else []


def held_out_indices(count: int, config: RunConfig) -> set[int]:
    """Which of ``count`` examples are held out: ``data.eval_fraction`` of them (None: the automatic count), chosen
    with the run's seed."""
    fraction = config.data.eval_fraction
    held = held_out_count(count) if fraction is None else max(1, round(count * fraction))
    if (fraction is not None and fraction <= 0) or count < 2 or held == 0:
        return set()
    order = list(range(count))
    random.Random(config.training.seed).shuffle(order)
    return set(order[:held])


def held_out_split(config: RunConfig) -> tuple[list[VisionExample], list[VisionExample]]:
    """The run's training and held-out examples, as the run split them."""
    examples, separate = _read(config)
    if separate:
        return examples, separate
    held = held_out_indices(len(examples), config)
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def _kept(encoded: Sequence[EncodedExample], max_len: int) -> tuple[list[EncodedExample], int]:
    """The examples that fit ``max_len`` tokens and learn something, and how many did not (an image cannot be cut
    in half)."""
    kept = [item for item in encoded if len(item) <= max_len and item.trained_tokens > 0]
    return kept, len(encoded) - len(kept)


def encoded_held_out(processor: Any, config: RunConfig, budget: int) -> list[EncodedExample]:
    """The run's held-out examples, encoded and kept as the run kept them."""
    _, held_out = held_out_split(config)
    kept, _ = _kept([encode(processor, e, budget) for e in held_out], config.data.max_seq_len or AUTOMATIC_TOKENS)
    return kept


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


def largest_micro_batch(session: VisionSession) -> list[int]:
    """The micro-batch of the most padded tokens (indices into ``session.train``)."""
    return largest_row(session.rows, session.train)


def largest_row(rows: Sequence[list[int]], examples: Sequence[EncodedExample]) -> list[int]:
    """The row of ``rows`` (indices into ``examples``) of the most padded tokens."""
    return max(rows, key=lambda r: max(len(examples[i]) for i in r) * len(r))


def planned_memory(session: VisionSession, config_dict: dict[str, Any]) -> MemoryEstimate:
    """The memory planner's estimate for the run's largest micro-batch (engine.vision.memory)."""
    recompute = bool(session.model.base_model.model.is_gradient_checkpointing)
    dtype_bytes = next(session.model.parameters()).element_size()
    row = largest_micro_batch(session)
    return row_plan(session.config, config_dict, session.family, [session.train[i] for i in row],
                    session.max_pixels, recompute, dtype_bytes)  # fmt: skip


def row_plan(
    config: RunConfig,
    config_dict: dict[str, Any],
    family: VisionFamily,
    row: Sequence[EncodedExample],
    max_pixels: int,
    recompute: bool,
    dtype_bytes: int,
) -> MemoryEstimate:
    """The memory planner's estimate for one padded micro-batch of ``row`` (engine.vision.memory)."""
    from engine.hardware.planner import TrainSetup
    from engine.vision.memory import vision_step_estimate

    padded = max(len(item) for item in row) * len(row)
    setup = TrainSetup(
        tokens=max(1, padded - sum(item.image_tokens for item in row)),
        qlora=config.model.qlora,
        lora_rank=config.lora.sized().rank,
        checkpointing="standard" if recompute else "none",
        dtype_bytes=dtype_bytes,
    )
    return vision_step_estimate(
        config_dict, family, setup, images_per_row=sum(len(item.example.images) for item in row),
        max_pixels=max_pixels, adapt_vision=config.vision.adapt_vision,
        image_tokens=sum(item.image_tokens for item in row),
    )  # fmt: skip


def _recompute(
    config: RunConfig,
    model_config: dict[str, Any] | None,
    family: VisionFamily,
    train: Sequence[EncodedExample],
    max_pixels: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Recompute:
    """Whether the run recomputes activations (engine.vision.speed.choose_recompute): automatic on a GPU asks the
    planner for the largest micro-batch's peak without recompute and the memory this process can reach now."""
    mode, on_gpu = config.speed.checkpointing, device.type == "cuda"
    if model_config is None or mode != "auto" or not on_gpu:
        return choose_recompute(mode, on_gpu, None, None)
    largest = largest_row(padded_rows(train, config.data.tokens_per_batch or AUTOMATIC_TOKENS), train)
    peak = row_plan(config, model_config, family, [train[i] for i in largest], max_pixels, False, dtype.itemsize).peak
    return choose_recompute(mode, on_gpu, peak, reachable_device_memory(device))


def planned_peak(session: VisionSession, config_dict: dict[str, Any]) -> str:
    """The memory planner's peak for the run's largest micro-batch, in words."""
    from engine.hardware.planner import GIB

    estimate = planned_memory(session, config_dict)
    row = largest_micro_batch(session)
    padded = max(len(session.train[i]) for i in row) * len(row)
    images = sum(len(session.train[i].example.images) for i in row)
    return (
        f"memory plan: about {estimate.peak / GIB:.1f} GiB at the largest micro-batch ({len(row)} examples, "
        f"{images} images, {padded:,} padded tokens), the vision tower's {estimate.parts['vision_tower'] / GIB:.2f} "
        "GiB included"
    )


def expected_seconds(session: VisionSession) -> float | None:
    """A CPU run's training time before its first step, from the planner's step time for its language model over
    the padded micro-batches (a GPU run's time is known after its first steps)."""
    from engine.hardware.row_lengths import cpu_step_seconds
    from engine.run.estimate import cpu_run_seconds

    shape = model_shape(session.config.model)
    if session.device.type != "cpu" or shape is None:
        return None
    tokens = sum(max(len(session.train[i]) for i in row) * len(row) for row in session.rows) / len(session.rows)
    step_s = cpu_step_seconds(shape, round(tokens), torch.get_num_threads(), session.config.model.qlora)
    training = session.config.training
    return cpu_run_seconds(
        step_s,
        session.total_steps - session.step,
        training.grad_accum,
        len(session.eval_rows),
        training.eval_every or 0,
    )
