"""One optimizer step of a run, and an evaluation pass over the held-out rows.

A step trains on ``grad_accum`` packed rows (this rank's share of them), splits a row into smaller
micro-batches after an out-of-memory error (engine.run.guard), skips the update when the loss or gradient is not
finite, and reports :class:`~engine.events.StepMetrics`. The loss of a step is the sum over its trained tokens
divided by their count over the whole step, so micro-batching and ranks never change what is learned. With late
readout (engine.run.readout) a step is queued whole, its skip decided on the GPU, and its metrics reported after
the next step is queued; the training loop reads a step at once where an evaluation, a checkpoint, a pause or the
end follows it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Generator, Iterator

import torch

from engine.data.packing import IGNORE_INDEX, PackedBatch, TokenizedExample, collate
from engine.events import EvalMetrics, Event, OomRecovered, SpeedChanged, SpeedRestored, StepMetrics, StepSkipped
from engine.hardware import vram
from engine.run import checkpoint as ckpt
from engine.run import guard, readout
from engine.run.folder import CHECKPOINT_DIR, EVAL_FILE, MEMORY_FILE, append_jsonl
from engine.run.methods.base import HeldOut, StepTokens
from engine.run.ranks import plain_number
from engine.run.session import Session
from engine.speed import GRAPHS_SHORT_OF_MEMORY, usable_device_memory


def _next_rows(session: Session) -> list[int]:
    """The packed rows of the next step (``grad_accum`` of them), advancing the data position."""
    rows = []
    for _ in range(session.config.training.grad_accum):
        rows.append(session.schedule.row(session.micro_batches))
        session.micro_batches += 1
    return rows


def _row_groups(examples: list[TokenizedExample], row: list[int], budget: int) -> list[list[TokenizedExample]]:
    """One packed row's documents as micro-batches of at most ``budget`` tokens (one unless memory ran short)."""
    return [
        [examples[row[position]] for position in group]
        for group in guard.split_row([len(examples[i]) for i in row], budget)
    ]


def _longest_document(examples: list[TokenizedExample], rows: list[list[int]]) -> int:
    return max((len(examples[i]) for row in rows for i in row), default=1)


def _forward_loss(session: Session, batch: PackedBatch, num_items: int) -> torch.Tensor:
    on_device = batch.to(session.device)
    inputs = session.speed.model_inputs(on_device)

    def compute(model: torch.nn.Module) -> torch.Tensor:
        return session.speed.loss(model, inputs, on_device.labels, num_items, positions=on_device.loss_positions)

    # through DDP / the FSDP2 root, whose hooks must see the forward (the fused loss bypasses the model's own)
    return session.loss_module(compute) if session.loss_module is not None else compute(session.model)


def _forward_backward(session: Session, batch: PackedBatch, num_items: int) -> torch.Tensor:
    """One micro-batch's forward and backward; its detached loss. With step graphs on, the speed controller replays
    the work from a CUDA graph (runs with several processes or loss scaling keep them off: session.start)."""
    if session.speed.graphs.active:
        return session.speed.forward_backward(session.model, batch.to(session.device), num_items)
    loss = _forward_loss(session, batch, num_items)
    scaled = loss * session.ranks.loss_scale if session.ranks.distributed else loss
    (session.scaler.scale(scaled) if session.scaler is not None else scaled).backward()
    return loss.detach()


def _without_labels(batch: PackedBatch) -> PackedBatch:
    """The same tokens with nothing to learn: a padding pass that gives zero loss and zero gradient."""
    ignored = torch.full_like(batch.labels, IGNORE_INDEX)
    return dataclasses.replace(batch, labels=ignored, loss_positions=torch.zeros(0, dtype=torch.long))


def _rank_batches(session: Session, per_row: list[list[list[TokenizedExample]]]) -> list[PackedBatch]:
    """This rank's micro-batches of the step (only its own rows are collated), padded so that every rank runs
    the same number of passes."""
    ranks = session.ranks
    mine = [collate(group) for row in ranks.share(per_row) for group in row]
    if not ranks.distributed:
        return mine
    missing = ranks.passes([len(row) for row in per_row]) - len(mine)
    if missing <= 0:
        return mine
    shortest = min((group for row in per_row for group in row), key=lambda g: sum(len(ex) for ex in g))
    return mine + [_without_labels(collate(shortest))] * missing


def _accumulate(session: Session, rows: list[int]) -> tuple[torch.Tensor, StepTokens]:
    """Forward and backward over the step's rows, as the run's training method makes them (engine.run.methods)."""
    return session.method.accumulate(session, rows)


def accumulate_documents(session: Session, rows: list[int]) -> tuple[torch.Tensor, StepTokens]:
    """Forward and backward over the step's packed rows of documents (this rank's share of them); the loss is the
    sum over trained tokens / their count over the whole step, this rank's part of it under several ranks."""
    data = session.data
    documents = [data.train[i] for r in rows for i in data.train_rows[r]]
    counted = StepTokens(sum(len(ex) for ex in documents), sum(ex.trained_tokens for ex in documents))
    per_row = [_row_groups(data.train, data.train_rows[r], session.tokens_per_batch) for r in rows]
    mine = _rank_batches(session, per_row)
    ranks = session.ranks
    total = torch.zeros((), device=session.device)
    for i, batch in enumerate(mine):
        with ranks.accumulating(session.loss_module, last=i == len(mine) - 1):
            loss = _forward_backward(session, batch, counted.trained)
        total += loss.float()
    return total, counted


def _accumulate_or_lower(session: Session, rows: list[int]) -> Generator[Event, None, tuple[torch.Tensor, StepTokens]]:
    """Run the step's forward/backward; after an out-of-memory error, retry once as it was, then lower one setting
    at a time (engine.run.guard) and retry."""
    while True:
        try:
            total, counted = _accumulate(session, rows)
            if session.anchor is not None:  # its gradients join the step's before the update reads them
                session.anchor.backward(session.model)
            return total, counted
        except Exception as err:
            if not guard.is_out_of_memory(err):
                raise
            if session.ranks.distributed:  # the other ranks are already waiting in this step's collectives
                raise guard.out_of_memory_error(session.step + 1, session.tokens_per_batch) from err
        # outside the except block: the traceback (and the activations its frames hold) is gone by now
        guard.release_memory(session.optimizer, session.device)
        step = session.step + 1
        if session.recovery.retry_first(step):
            yield _logged(session, OomRecovered(step, guard.RETRY, session.tokens_per_batch, RETRY_MESSAGE))
            continue
        yield from _lower_one(session, [session.data.train_rows[r] for r in rows], session.data.train)


RETRY_MESSAGE = "out of GPU memory: cached memory released, retrying the step with the same settings"


def _lower_one(session: Session, rows: list[list[int]], examples: list[TokenizedExample]) -> Iterator[Event]:
    """Lower the least costly setting that holds memory: what the speed switches hold beyond the step's own need
    first (resident layers, then the step graphs' pool), then the micro-batches and the recompute."""
    given_up = session.speed.give_up_memory()
    if given_up is None:
        yield from _lower_memory(session, rows, examples)
        return
    session.recovery.lowered_now(given_up, session.step + 1)
    guard.release_memory(session.optimizer, session.device)
    message = GIVEN_UP_MESSAGES[given_up]
    yield _logged(session, OomRecovered(session.step + 1, given_up, session.tokens_per_batch, message))
    yield SpeedChanged(session.step, session.speed.state())


GIVEN_UP_MESSAGES = {
    guard.RESIDENT_LAYERS: "out of GPU memory again: every layer recomputes its activations for now (resident "
    "layers are tried again once memory has room)",
    guard.STEP_GRAPHS: "out of GPU memory again: micro-batches run eagerly for now, without the step graphs' memory "
    "pool (tried again once memory has room)",
}


def _lower_memory(session: Session, rows: list[list[int]], examples: list[TokenizedExample]) -> Iterator[Event]:
    state = session.speed.state()
    offloaded = state.get("checkpointing", {}).get("mode") == "offloaded"
    chunked = bool(state.get("chunked_mlp", {}).get("on"))
    longest = _longest_document(examples, rows)
    action = guard.next_oom_action(
        session.tokens_per_batch, longest, session.offload_tried or offloaded, session.chunks_tried or chunked
    )
    if action is None:
        raise guard.out_of_memory_error(session.step + 1, session.tokens_per_batch)
    message = action.describe(session.tokens_per_batch)
    settings = session.speed.settings
    previous = {
        guard.TOKENS_PER_BATCH: session.tokens_per_batch,
        guard.OFFLOADED_CHECKPOINTING: settings.checkpointing,
        guard.CHUNKED_MLP: settings.chunked_mlp,
    }[action.kind]
    session.recovery.lowered_now(action.kind, session.step + 1, previous)
    session.tokens_per_batch = action.tokens_per_batch
    yield _logged(session, OomRecovered(session.step + 1, action.kind, action.tokens_per_batch, message))
    if action.kind in (guard.OFFLOADED_CHECKPOINTING, guard.CHUNKED_MLP):
        session.offload_tried = session.offload_tried or action.kind == guard.OFFLOADED_CHECKPOINTING
        session.chunks_tried = session.chunks_tried or action.kind == guard.CHUNKED_MLP
        session.speed.apply(guard.fallback_settings(action.kind, settings))
        yield SpeedChanged(session.step, session.speed.state())


def _logged(session: Session, event: OomRecovered | SpeedRestored) -> OomRecovered | SpeedRestored:
    """The event, also written to the run folder's memory log."""
    if session.ranks.is_main:
        append_jsonl(session.run_dir / MEMORY_FILE, event.to_dict())
    return event


def climb_back(session: Session) -> Iterator[Event]:
    """Undo the most recent out-of-memory lowering once enough good steps left room (engine.run.guard.Recovery)."""
    usable = usable_device_memory(session.device) if session.device.type == "cuda" else None
    lowered = session.recovery.due(usable)
    if lowered is None:
        return
    _undo(session, lowered)
    session.recovery.climbed_back(lowered)
    yield _logged(session, SpeedRestored(session.step + 1, lowered.kind, lowered.describe()))
    yield SpeedChanged(session.step, session.speed.state())


def _undo(session: Session, lowered: guard.Lowered) -> None:
    speed = session.speed
    if lowered.kind == guard.RESIDENT_LAYERS:
        speed.restore_resident_layers()
    elif lowered.kind == guard.STEP_GRAPHS:
        speed.restore_step_graphs()
    elif lowered.kind == guard.TOKENS_PER_BATCH:
        session.tokens_per_batch = max(session.tokens_per_batch, int(lowered.previous))
    elif lowered.kind == guard.OFFLOADED_CHECKPOINTING:
        session.offload_tried = False
        speed.apply(dataclasses.replace(speed.settings, checkpointing=lowered.previous))
    elif lowered.kind == guard.CHUNKED_MLP:
        session.chunks_tried = False
        speed.apply(dataclasses.replace(speed.settings, chunked_mlp=lowered.previous))


def _clip_gradients(session: Session) -> float:
    max_norm = session.config.training.max_grad_norm or math.inf
    if session.scaler is not None:
        session.scaler.unscale_(session.optimizer)
    return plain_number(torch.nn.utils.clip_grad_norm_(session.trainable, max_norm))


def _optimizer_step(session: Session) -> None:
    if session.scaler is not None:
        session.scaler.step(session.optimizer)
        session.scaler.update()
    else:
        session.optimizer.step()
    session.scheduler.step()
    session.speed.zero_grad(session.optimizer)


def _is_bad_step(session: Session, loss: float, grad_norm: float) -> bool:
    # With fp16 loss scaling, inf gradients are the scaler's business: it skips the step and lowers the scale.
    return not math.isfinite(loss) or (session.scaler is None and not math.isfinite(grad_norm))


def _skip_update(session: Session, loss: float, grad_norm: float) -> StepSkipped:
    """Throw the step's gradients away; the weights, optimizer moments and learning-rate schedule stay as they were."""
    session.speed.zero_grad(session.optimizer)
    if session.scaler is not None:
        session.scaler.update()
    counter = session.non_finite
    counter.bad(session.step + 1)
    return StepSkipped(session.step + 1, loss, grad_norm, counter.in_a_row, counter.total)


def _last_checkpoint(session: Session) -> str | None:
    found = ckpt.list_checkpoints(session.run_dir / CHECKPOINT_DIR)
    return str(found[-1]) if found else None


def train_step(session: Session) -> Generator[Event, None, list[StepMetrics]]:
    """One optimizer step over ``grad_accum`` packed rows. Returns the metrics of the steps the host has now read:
    this one (read at once), or the one queued before it (read late: engine.run.readout); none when skipped."""
    if session.late_readout:
        return (yield from _queue_and_read_previous(session))
    metrics = yield from _step_read_at_once(session)
    return [] if metrics is None else [metrics]


def _step_read_at_once(session: Session) -> Generator[Event, None, StepMetrics | None]:
    vram.reset_step_peak(session.device)
    start = time.perf_counter()
    learning_rate = float(session.scheduler.get_last_lr()[0])
    rows = _next_rows(session)
    total, counted = yield from _accumulate_or_lower(session, rows)
    loss_value = float(total)
    rank_memory: list[int] | None = None
    rank_busy: list[float] | None = None
    if session.ranks.distributed:  # one small all-reduce: the step's loss, every rank's peak memory and busy time
        busy = session.ranks.clock.busy_s(start)
        reduced = session.ranks.reduce_step_figures(loss_value, _memory_bytes(session.device), busy)
        loss_value, rank_memory, rank_busy = reduced
    grad_norm = _clip_gradients(session)
    if _is_bad_step(session, loss_value, grad_norm):
        yield _skip_update(session, loss_value, grad_norm)
        if session.non_finite.exhausted:
            raise session.non_finite.error(_last_checkpoint(session))
        return None
    session.non_finite.good()
    _optimizer_step(session)
    elapsed = time.perf_counter() - start
    memory = max(rank_memory) if rank_memory else _memory_bytes(session.device)
    epoch = session.schedule.epoch(session.micro_batches)
    metrics = _good_step(session, loss_value, grad_norm, learning_rate, counted, elapsed, memory, epoch, rank_memory)
    return dataclasses.replace(metrics, rank_busy_s=rank_busy) if rank_busy is not None else metrics


def _good_step(
    session: Session,
    loss: float,
    grad_norm: float,
    learning_rate: float,
    counted: StepTokens,
    elapsed: float,
    memory_bytes: int,
    epoch: float,
    rank_memory: list[int] | None = None,
) -> StepMetrics:
    """Count a step whose update went in, and its metrics."""
    session.step += 1
    session.last_loss = loss
    session.recovery.good_step(memory_bytes)
    metrics = StepMetrics(
        step=session.step,
        total_steps=session.total_steps,
        epoch=epoch,
        loss=loss,
        learning_rate=learning_rate,
        grad_norm=grad_norm,
        tokens=counted.tokens,
        trained_tokens=counted.trained,
        step_time_s=elapsed,
        tokens_per_s=counted.tokens / elapsed if elapsed > 0 else 0.0,
        memory_bytes=memory_bytes,
        rank_memory_bytes=rank_memory,
    )
    return session.method.reported(metrics)


def _queue_and_read_previous(session: Session) -> Generator[Event, None, list[StepMetrics]]:
    """Queue this step whole (update included), then read the step queued before it, which the GPU has finished
    by now or is finishing while this one waits behind it."""
    previous = session.in_flight
    session.in_flight = yield from _queue_step(session)
    return (yield from _read_one(session, previous))


def read_in_flight(session: Session) -> Generator[Event, None, list[StepMetrics]]:
    """Read the step still in flight, if any (before an evaluation, a checkpoint, a pause or the end of the run)."""
    previous, session.in_flight = session.in_flight, None
    return (yield from _read_one(session, previous))


def _read_one(session: Session, step: readout.InFlight | None) -> Generator[Event, None, list[StepMetrics]]:
    if step is None:
        return []
    metrics = yield from _read(session, step)
    return [] if metrics is None else [metrics]


def _queue_step(session: Session) -> Generator[Event, None, readout.InFlight]:
    vram.reset_step_peak(session.device)
    started, began = time.perf_counter(), readout.began_event(session.device)
    learning_rate = float(session.scheduler.get_last_lr()[0])
    rows = _next_rows(session)
    total, counted = yield from _accumulate_or_lower(session, rows)
    max_norm = session.config.training.max_grad_norm
    values = readout.update_on_device(session.optimizer, session.trainable, total, max_norm)
    session.scheduler.step()
    session.speed.zero_grad(session.optimizer)
    return readout.InFlight(
        readout.send(values, began, started),
        learning_rate,
        counted.tokens,
        counted.trained,
        session.schedule.epoch(session.micro_batches),
        _memory_bytes(session.device),
    )


def _read(session: Session, step: readout.InFlight) -> Generator[Event, None, StepMetrics | None]:
    loss, grad_norm, skipped, seconds = step.readback.read()
    if skipped:  # the GPU left weights and moments alone; the schedule advanced at queue time, so it goes back
        readout.rewind_schedule(session.scheduler)
        counter = session.non_finite
        counter.bad(session.step + 1)
        yield StepSkipped(session.step + 1, loss, grad_norm, counter.in_a_row, counter.total)
        if counter.exhausted:
            raise counter.error(_last_checkpoint(session))
        return None
    session.non_finite.good()
    counted = StepTokens(step.tokens, step.trained_tokens)
    return _good_step(session, loss, grad_norm, step.learning_rate, counted, seconds, step.memory_bytes, step.epoch)


def _memory_bytes(device: torch.device) -> int:
    """The step's true peak (engine.hardware.vram): reserved memory, step graphs' pool included; on CPU, the RSS."""
    return vram.read_step_peak(device, driver=False).true_peak


def evaluate_loss(session: Session) -> HeldOut | None:
    """The run's held-out figures as its training method measures them, or None without an eval split."""
    return session.method.evaluate(session)


@torch.no_grad()
def evaluate_documents(session: Session) -> tuple[float, int] | None:
    """Mean loss per trained token over the held-out rows of documents, or None without an eval split."""
    data = session.data
    groups = [[g] for row in data.eval_rows for g in _row_groups(data.eval, row, session.tokens_per_batch)]
    if not groups:
        return None
    mine = _rank_batches(session, groups)
    session.model.eval()
    total, tokens = 0.0, 0
    try:
        for batch in mine:
            n = batch.trained_tokens
            loss = _forward_loss(session, batch, max(n, 1))  # a padding pass (n == 0) only keeps ranks in step
            if n:
                total += float(loss) * n
                tokens += n
    finally:
        session.model.train()
    total, all_tokens = session.ranks.reduce_sums(total, tokens)
    return total / max(all_tokens, 1), int(all_tokens)


def evaluate(session: Session) -> Iterator[Event]:
    while True:
        try:
            result = evaluate_loss(session)
            break
        except Exception as err:
            if not guard.is_out_of_memory(err):
                raise
        # evaluation keeps no activations: only the step graphs' pool is worth freeing here
        dropped = session.speed.graphs.give_up(GRAPHS_SHORT_OF_MEMORY)
        guard.release_memory(session.optimizer, session.device)
        if dropped:
            session.recovery.lowered_now(guard.STEP_GRAPHS, session.step)
            yield SpeedChanged(session.step, session.speed.state())
        else:
            yield from _lower_memory(session, session.data.eval_rows, session.data.eval)
    if result is None:
        return
    loss, tokens, accuracy = result.loss, result.tokens, result.reward_accuracy
    session.last_eval = loss
    reward = result.reward_mean
    if session.ranks.is_main:
        record = {"step": session.step, "eval_loss": loss, "tokens": tokens}
        if accuracy is not None:
            record["reward_accuracy"] = accuracy
        if reward is not None:
            record["reward_mean"] = reward
        append_jsonl(session.run_dir / EVAL_FILE, record)
    yield EvalMetrics(session.step, loss, tokens, accuracy, reward)
