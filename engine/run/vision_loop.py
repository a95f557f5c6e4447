"""The training loop of a vision-language run: the same events, run folder and files as a text run.

Each step trains on ``grad_accum`` padded micro-batches; its loss is the sum over the learned tokens divided by
their count over the whole step (as for text). Held-out examples are evaluated every ``training.eval_every``
steps and at the end, a new lowest held-out loss keeps ``adapter-best/``, checkpoints are written every
``training.save_every`` steps, and a resumed run continues from the newest whole checkpoint. The adapter is saved
with the processor (tokenizer, image processor and chat template), so it loads in plain peft and chats with images.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.config import RunConfig
from engine.data.packing import IGNORE_INDEX
from engine.events import (
    BestAdapterKept,
    CheckpointSaved,
    EvalMetrics,
    Event,
    Notice,
    RunFinished,
    RunPaused,
    RunResumed,
    RunStarted,
    StepMetrics,
)
from engine.hardware import vram
from engine.run import checkpoint as ckpt
from engine.run import vision_guard
from engine.run.best import BestAdapterWriter, host_copy
from engine.run.control import RunControl
from engine.run.folder import (
    ADAPTER_DIR,
    BEST_ADAPTER_DIR,
    CHECKPOINT_DIR,
    EVAL_FILE,
    METRICS_FILE,
    append_jsonl,
    save_adapter,
)
from engine.run.loop import failure
from engine.run.vision_session import (
    VisionSession,
    expected_seconds,
    padding_efficiency,
    parameter_counts,
    planned_peak,
    start_vision,
)
from engine.vision.encode import EncodedExample, batch
from engine.vision.families import VisionFamily
from engine.vision.images import ImageCache

SPEED_FIXED = (
    "speed switches do not change during a picture run: the packed-text switches do not apply to image rows, and "
    "activation checkpointing is set when the run starts"
)


def train_vision(
    config: RunConfig, run_dir: Path, resuming: bool, control: RunControl, family: VisionFamily
) -> Iterator[Event]:
    """A whole vision-language run in this process, in ``run_dir`` (already holding its config.json)."""
    session: VisionSession | None = None
    try:
        session = yield from start_vision(config, run_dir, family, resuming)
        if resuming:
            yield from _restore(session)
        if session.model_config is not None:
            yield Notice(planned_peak(session, session.model_config))
        yield _started(session)
        writer = BestAdapterWriter(run_dir)
        try:
            yield from _steps(session, control, writer)
        finally:
            writer.shutdown()
    except Exception as err:  # the user gets a message and a log, never a dead app
        failed = failure(err, None, run_dir, write_log=True)
        yield dataclasses.replace(failed, step=session.step if session else 0)


def _started(session: VisionSession) -> RunStarted:
    trainable, total = parameter_counts(session)
    estimated = expected_seconds(session)
    return RunStarted(
        run_dir=str(session.run_dir),
        device=str(session.device),
        dtype=str(next(session.model.parameters()).dtype).replace("torch.", ""),
        total_steps=session.total_steps,
        start_step=session.step,
        train_examples=len(session.train),
        eval_examples=len(session.eval),
        train_rows=len(session.rows),
        packing_efficiency=padding_efficiency(session.train, session.rows),
        trainable_params=trainable,
        total_params=total,
        estimated_s=estimated,
        estimate_basis="from the planner's figure for this CPU" if estimated is not None else "",
    )


def _steps(session: VisionSession, control: RunControl, writer: BestAdapterWriter) -> Iterator[Event]:
    started = time.perf_counter()
    every = session.config.training
    while session.step < session.total_steps and not session.eval_watch.stopping:
        control.sync()
        if control.take_speed_request() is not None:
            yield Notice(SPEED_FIXED)
        if control.stop_requested:
            break
        if control.paused:
            yield RunPaused(session.step)
            control.wait_while_paused()
            if control.stop_requested:
                break
            yield RunResumed(session.step)
        yield from vision_guard.climb_back(session)  # a setting lowered for memory, once good steps left room
        metrics = yield from train_step(session)
        append_jsonl(session.run_dir / METRICS_FILE, _record(metrics))
        yield metrics
        if not (math.isfinite(metrics.loss) and math.isfinite(metrics.grad_norm)):
            yield Notice(f"step {metrics.step}: the loss or the gradient was not finite; its update was skipped")
        if every.eval_every and session.step % every.eval_every == 0 and session.step < session.total_steps:
            yield from _evaluate(session, writer)
        if every.save_every and session.step % every.save_every == 0 and session.step < session.total_steps:
            yield save_checkpoint(session)
    cancelled = session.step < session.total_steps and not session.eval_watch.stopping
    yield from _finish(session, time.perf_counter() - started, cancelled, writer)


def on_device(model: Any, inputs: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``inputs`` on ``device``, floating-point ones (pixels) in the model's dtype."""
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    return {key: value.to(device, dtype=dtype if value.is_floating_point() else None) for key, value in inputs.items()}


def loss_sum(
    model: Any,
    processor: Any,
    examples: Sequence[EncodedExample],
    max_pixels: int,
    device: torch.device,
    cache: ImageCache | None = None,
) -> tuple[torch.Tensor, int]:
    """The summed cross-entropy over the learned tokens of ``examples`` padded into one batch, and their count."""
    inputs = on_device(model, batch(processor, examples, max_pixels, cache), device)
    labels = inputs.pop("labels")[:, 1:]
    logits = model(**inputs, use_cache=False).logits[:, :-1]
    total = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total, int((labels != IGNORE_INDEX).sum())


def summed_loss(
    session: VisionSession, rows: list[list[int]], examples: list[EncodedExample]
) -> tuple[torch.Tensor, int]:
    """The summed loss over the learned tokens of ``rows`` (micro-batches of ``examples``), and their count."""
    total = torch.zeros((), device=session.device)
    count = 0
    for row in rows:
        chosen = [examples[i] for i in row]
        loss, tokens = loss_sum(
            session.model, session.processor, chosen, session.max_pixels, session.device, session.images
        )
        total, count = total + loss, count + tokens
    return total, count


def train_step(session: VisionSession) -> Generator[Event, None, StepMetrics]:
    """One optimizer step over ``grad_accum`` micro-batches, split smaller or recomputed while memory runs short
    (engine.run.vision_guard)."""
    began = time.perf_counter()
    vram.reset_step_peak(session.device)
    rows: list[list[int]] = []
    for _ in range(session.config.training.grad_accum):
        rows.append(session.rows[session.schedule.row(session.micro_batches + len(rows))])
    learned = sum(session.train[i].trained_tokens for row in rows for i in row)
    total = yield from vision_guard.guarded(session, rows, lambda: _backward(session, rows, learned), save_checkpoint)
    session.micro_batches += len(rows)  # only a step that ran moves on: a stopped one resumes from here
    max_norm = session.config.training.max_grad_norm or math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(session.trainable, max_norm))
    learning_rate = session.scheduler.get_last_lr()[0]
    if math.isfinite(total) and math.isfinite(grad_norm):  # a non-finite step would ruin the adapter: skip it
        session.optimizer.step()
    session.scheduler.step()
    session.optimizer.zero_grad(set_to_none=True)
    session.step += 1
    session.last_loss = total / max(1, learned)
    tokens = sum(len(session.train[i]) for row in rows for i in row)
    seconds = time.perf_counter() - began
    peak = vram.read_step_peak(session.device, driver=False).true_peak
    session.recovery.good_step(peak)
    return StepMetrics(
        step=session.step,
        total_steps=session.total_steps,
        epoch=session.schedule.epoch(session.micro_batches),
        loss=session.last_loss,
        learning_rate=float(learning_rate),
        grad_norm=grad_norm,
        tokens=tokens,
        trained_tokens=learned,
        step_time_s=seconds,
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        memory_bytes=peak,
    )


def _backward(session: VisionSession, rows: list[list[int]], learned: int) -> float:
    """Forward and backward over the step's micro-batches, one at a time (only one batch's activations are held);
    the summed loss over their learned tokens."""
    total = 0.0
    for chosen in vision_guard.micro_batches(session, rows):
        loss, _ = summed_loss(session, [chosen], session.train)
        (loss / max(1, learned)).backward()
        total += float(loss.detach())
    return total


def evaluate(session: VisionSession) -> EvalMetrics | None:
    """The mean loss over the held-out examples' learned tokens (None without held-out examples)."""
    if not session.eval:
        return None
    session.model.eval()
    try:
        with torch.no_grad():
            total, count = summed_loss(session, session.eval_rows, session.eval)
    finally:
        session.model.train()
    session.last_eval = float(total) / max(1, count)
    return EvalMetrics(session.step, session.last_eval, count)


def _evaluate(session: VisionSession, writer: BestAdapterWriter) -> Iterator[Event]:
    metrics = evaluate(session)
    if metrics is None:
        return
    append_jsonl(
        session.run_dir / EVAL_FILE, {"step": metrics.step, "eval_loss": metrics.loss, "tokens": metrics.tokens}
    )
    yield metrics
    verdict = session.eval_watch.observe(metrics.step, metrics.loss)
    if verdict.improved:
        writer.write(session.model, session.processor, host_copy(session.model, None), metrics.step, metrics.loss)
        yield BestAdapterKept(metrics.step, metrics.loss, str(session.run_dir / BEST_ADAPTER_DIR))
    if verdict.stop:
        yield Notice(session.eval_watch.stop_message())


def save_checkpoint(session: VisionSession) -> CheckpointSaved:
    from peft import get_peft_model_state_dict

    state = ckpt.TrainerState(
        session.step,
        session.micro_batches,
        len(session.rows),
        session.total_steps,
        session.config.data.tokens_per_batch,
    )
    for log in (METRICS_FILE, EVAL_FILE):  # a durable checkpoint must not outlive the log lines before it
        if (session.run_dir / log).exists():
            ckpt.fsync_file(session.run_dir / log)
    path = ckpt.save_checkpoint(
        session.run_dir / CHECKPOINT_DIR,
        state,
        get_peft_model_state_dict(session.model),
        session.optimizer,
        session.scheduler,
        session.config.output.keep_checkpoints,
    )
    return CheckpointSaved(session.step, str(path))


def _restore(session: VisionSession) -> Iterator[Event]:
    """Continue from the newest whole checkpoint; damaged ones are skipped."""
    from peft import set_peft_model_state_dict

    for checkpoint in reversed(ckpt.list_checkpoints(session.run_dir / CHECKPOINT_DIR)):
        problem = ckpt.checkpoint_problem(checkpoint)
        if problem is None:
            state = ckpt.load_trainer_state(checkpoint)
            if state.train_rows != len(session.rows):
                problem = (
                    f"it was made with {state.train_rows} micro-batches of examples, this data has {len(session.rows)}"
                )
        if problem is not None:
            yield Notice(f"checkpoint {checkpoint.name} was skipped: {problem}")
            continue
        weights = ckpt.load_checkpoint(checkpoint, session.optimizer, session.scheduler)
        set_peft_model_state_dict(session.model, {k: v.to(session.device) for k, v in weights.items()})
        session.step, session.micro_batches = state.step, state.micro_batches
        yield Notice(f"resuming from {checkpoint.name} (step {state.step})")
        return
    yield Notice(f"{session.run_dir} has no usable checkpoint yet; training starts from the beginning")


def _finish(session: VisionSession, wall_time: float, cancelled: bool, writer: BestAdapterWriter) -> Iterator[Event]:
    watch = session.eval_watch
    if not cancelled and watch.last_step != session.step:
        yield from _evaluate(session, writer)
    yield save_checkpoint(session)
    writer.wait()  # the best adapter is on disk before the run says it finished
    adapter_dir = session.run_dir / ADAPTER_DIR
    try:
        save_adapter(session.model, session.processor, adapter_dir)
    except OSError as err:
        raise ckpt.write_error(err, "final adapter", adapter_dir) from err
    yield RunFinished(
        step=session.step,
        run_dir=str(session.run_dir),
        adapter_dir=str(adapter_dir),
        final_loss=session.last_loss,
        eval_loss=session.last_eval,
        wall_time_s=wall_time,
        cancelled=cancelled,
        best_adapter_dir=str(session.run_dir / BEST_ADAPTER_DIR) if watch.best_step is not None else None,
        best_step=watch.best_step,
        best_eval_loss=watch.best_loss,
        stopped_early=watch.stopping,
    )


def _record(metrics: StepMetrics) -> dict[str, Any]:
    record = metrics.to_dict()
    record.pop("kind")
    return record
