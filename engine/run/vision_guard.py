"""Keeping a picture run alive through out-of-memory steps, as text runs are kept (engine.run.guard).

A CUDA OOM inside a step leaves the optimizer untouched, so the step is simply taken again. The first try releases
what the failed attempt left cached and runs the same settings once more. When that fails too, one thing is
lowered at a time: first the micro-batch (the step's padded micro-batches are split into smaller ones of at most
half the padded tokens, never below one example: an image cannot be cut), then transformers' recompute is turned
on if the run trains without it. Rows hold examples of similar length padded together and the loss is a sum over
learned tokens divided by their count over the whole step, so smaller micro-batches train the same update (to
float rounding). When nothing is left to lower, a checkpoint of the finished steps is written and the run stops
saying so; it resumes from there. A lowered setting is tried again after enough good steps (guard.Recovery).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TypeVar

from engine.events import CheckpointSaved, Event, OomRecovered, SpeedRestored
from engine.run import guard
from engine.run.folder import MEMORY_FILE, append_jsonl
from engine.run.vision_session import VisionSession
from engine.speed import usable_device_memory
from engine.vision.model import enable_recompute

RECOMPUTE = "recompute"
"""The lowering that turns on transformers' recompute (activation checkpointing) for the rest of the shortage."""

RETRY_MESSAGE = "out of GPU memory: cached memory released, retrying the step with the same settings"
T = TypeVar("T")


def split_padded(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Positions of one micro-batch's examples (``lengths`` in rising order, as rows are built) as consecutive
    groups whose padded size (longest x count) stays within ``budget``; an example longer than it stands alone."""
    groups: list[list[int]] = []
    for position, length in enumerate(lengths):
        if groups and length * (len(groups[-1]) + 1) <= budget:
            groups[-1].append(position)
        else:
            groups.append([position])
    return groups


def micro_batches(session: VisionSession, rows: Sequence[Sequence[int]]) -> list[list[int]]:
    """The step's rows as the micro-batches the run's current budget allows (indices into ``session.train``)."""
    return [
        [row[position] for position in group]
        for row in rows
        for group in split_padded([len(session.train[i]) for i in row], session.tokens_per_batch)
    ]


def padded_size(session: VisionSession, batch: Sequence[int]) -> int:
    return max(len(session.train[i]) for i in batch) * len(batch)


def guarded(
    session: VisionSession,
    rows: Sequence[Sequence[int]],
    work: Callable[[], T],
    save: Callable[[VisionSession], CheckpointSaved],
) -> Generator[Event, None, T]:
    """``work()`` (the step's forwards and backwards); after an out-of-memory error, retry once as it was, then lower
    one setting at a time and retry; stop with a checkpoint of the finished steps (``save``) when nothing is
    left."""
    while True:
        try:
            return work()
        except Exception as err:
            if not guard.is_out_of_memory(err):
                raise
        # outside the except block: the traceback (and the activations its frames hold) is gone by now
        guard.release_memory(session.optimizer, session.device)
        step = session.step + 1
        if session.recovery.retry_first(step):
            yield _logged(session, OomRecovered(step, guard.RETRY, session.tokens_per_batch, RETRY_MESSAGE))
            continue
        yield from _lower_one(session, rows, save)


def _lower_one(
    session: VisionSession, rows: Sequence[Sequence[int]], save: Callable[[VisionSession], CheckpointSaved]
) -> Iterator[Event]:
    step = session.step + 1
    largest = max(padded_size(session, batch) for batch in micro_batches(session, rows))
    longest = max(len(session.train[i]) for row in rows for i in row)
    if largest > longest:  # some micro-batch still holds two examples or more
        previous, session.tokens_per_batch = session.tokens_per_batch, max(longest, largest // 2)
        session.recovery.lowered_now(guard.TOKENS_PER_BATCH, step, previous)
        message = (
            f"out of GPU memory: retrying the step with at most {session.tokens_per_batch} padded tokens per "
            f"micro-batch (was {previous}); the same examples are trained in smaller micro-batches"
        )
        yield _logged(session, OomRecovered(step, guard.TOKENS_PER_BATCH, session.tokens_per_batch, message))
        return
    if not recomputing(session):
        set_recompute(session, True)
        session.recovery.lowered_now(RECOMPUTE, step, False)
        message = "out of GPU memory: retrying the step with activation checkpointing on (slower, less memory)"
        yield _logged(session, OomRecovered(step, RECOMPUTE, session.tokens_per_batch, message))
        return
    saved: CheckpointSaved | None = save(session) if session.step > 0 else None
    if saved is not None:
        yield saved
    raise _halted(step, longest, saved)


def _halted(step: int, longest: int, saved: CheckpointSaved | None) -> guard.TrainingHalted:
    kept = f"the {step - 1} finished steps are saved in {saved.path}" if saved else "no step had finished yet"
    return guard.TrainingHalted(
        f"out of GPU memory at step {step}, even with one example ({longest} tokens, image tokens included) per "
        f"micro-batch and activation checkpointing on; training stopped and {kept}",
        hint="use QLoRA, a lower vision.max_pixels (fewer image tokens) or LoRA rank, or close other programs that "
        "use the GPU; then resume the run",
    )


def recomputing(session: VisionSession) -> bool:
    return bool(session.model.base_model.model.is_gradient_checkpointing)


def set_recompute(session: VisionSession, on: bool) -> None:
    model = session.model.base_model.model
    if on:
        enable_recompute(model)
    else:
        model.gradient_checkpointing_disable()
    session.model.train()


def climb_back(session: VisionSession) -> Iterator[Event]:
    """Undo the most recent out-of-memory lowering once enough good steps left room."""
    usable = usable_device_memory(session.device) if session.device.type == "cuda" else None
    lowered = session.recovery.due(usable)
    if lowered is None:
        return
    if lowered.kind == guard.TOKENS_PER_BATCH:
        session.tokens_per_batch = max(session.tokens_per_batch, int(lowered.previous))
        what = f"micro-batches of {lowered.previous} padded tokens"
    else:
        set_recompute(session, bool(lowered.previous))
        what = "training without activation checkpointing"
    session.recovery.climbed_back(lowered)
    message = f"memory has had room since step {lowered.step}: trying {what} again"
    yield _logged(session, SpeedRestored(session.step + 1, lowered.kind, message))


def _logged(session: VisionSession, event: OomRecovered | SpeedRestored) -> OomRecovered | SpeedRestored:
    """The event, also written to the run folder's memory log."""
    append_jsonl(session.run_dir / MEMORY_FILE, event.to_dict())
    return event
