"""The training loop of one process: steps, evaluations, checkpoints and the final adapter, as events.

:func:`train_in_process` runs a whole run in this process (one GPU or the CPU); :func:`run_rank` runs one rank
of a multi-GPU run (started by engine.distributed.worker), the same loop with its :class:`Ranks` share of every
step. Between two steps the loop obeys its :class:`~engine.run.control.RunControl` (stop, pause, new speed
settings). Failures end the iterator with a :class:`~engine.events.RunFailed` event instead of an exception.
The public entry point, which also starts multi-GPU runs, is :func:`engine.train.run`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.config import RunConfig
from engine.errors import TuneDeckError
from engine.events import (
    BestAdapterKept,
    CheckpointSaved,
    EvalMetrics,
    EvalRising,
    Event,
    Notice,
    RunFailed,
    RunFinished,
    RunPaused,
    RunResumed,
    SpeedChanged,
    StepMetrics,
)
from engine.hardware import vram
from engine.redact import known_tokens, redact_event
from engine.run import checkpoint as ckpt
from engine.run import guard
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
    write_error_log,
)
from engine.run.methods import method_for
from engine.run.ranks import Ranks
from engine.run.session import Session, start
from engine.run.step import climb_back, evaluate, read_in_flight, train_step
from engine.speed.stand_in import own_tree

USER_SET = {guard.OFFLOADED_CHECKPOINTING, guard.CHUNKED_MLP, guard.STEP_GRAPHS}
"""Lowerings a live switch change replaces (step graphs are captured anew after any switch change)."""


def train_in_process(config: RunConfig, run_dir: Path, resuming: bool, control: RunControl) -> Iterator[Event]:
    """A whole run in this process, in ``run_dir`` (already holding its config.json)."""
    session: Session | None = None
    try:
        session = yield from start(config, run_dir, resuming, method_for(config.training.method))
        yield from _train(session, control)
    except Exception as err:  # the user gets a message and a log, never a dead app
        yield failure(err, session, run_dir, write_log=True)


def run_rank(
    config: RunConfig, run_dir: Path, resuming: bool, ranks: Ranks, device: torch.device, control: RunControl
) -> Iterator[Event]:
    """One rank of a multi-GPU run (started by engine.distributed.worker); only rank 0's events are shown."""
    tokens = known_tokens()
    session: Session | None = None
    try:
        session = yield from start(config, run_dir, resuming, method_for(config.training.method), ranks, device)
        yield from _train(session, control)
    except Exception as err:
        yield redact_event(failure(err, session, run_dir, write_log=ranks.is_main), tokens)


def failure(err: Exception, session: Session | None, run_dir: Path | None, write_log: bool) -> RunFailed:
    step, folder = (session.step if session else 0), (str(run_dir) if run_dir else None)
    if isinstance(err, TuneDeckError):
        return RunFailed(err.message, err.hint, step, folder)
    log = write_error_log(run_dir, err) if write_log else None
    return RunFailed(
        f"unexpected error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
        f"details are in {log}" if log else None,
        step,
        folder,
    )


def resumed_config(saved: RunConfig, given: RunConfig) -> RunConfig:
    """A resumed run keeps its saved settings, except which GPUs and computers it now runs on and how they share
    the model."""
    now = given.training
    training = dataclasses.replace(
        saved.training,
        gpus=now.gpus,
        parallel=now.parallel,
        nodes=now.nodes,
        node_rank=now.node_rank,
        rendezvous=now.rendezvous,
        rendezvous_timeout=now.rendezvous_timeout,
        node_timeout=now.node_timeout,
    )
    return dataclasses.replace(saved, training=training)


def on_one_gpu(config: RunConfig, gpus: list[int]) -> RunConfig:
    """``--gpus 3`` style lists of one GPU train in this process on that GPU."""
    if len(gpus) != 1 or gpus[0] == 0 or config.training.device not in ("auto", "cuda"):
        return config
    training = dataclasses.replace(config.training, device=f"cuda:{gpus[0]}")
    return dataclasses.replace(config, training=training)


def _train(session: Session, control: RunControl) -> Iterator[Event]:
    yield from session.method.before_first_step(session)
    writer = BestAdapterWriter(session.run_dir) if session.ranks.is_main else None
    try:
        yield from _steps(session, control, writer)
    finally:
        if writer is not None:
            writer.shutdown()


def _steps(session: Session, control: RunControl, writer: BestAdapterWriter | None) -> Iterator[Event]:
    started = time.perf_counter()
    while session.step + (session.in_flight is not None) < session.total_steps and not session.eval_watch.stopping:
        control.sync()
        requested = control.take_speed_request()
        if control.stop_requested or control.paused or requested is not None:
            yield from _reported(session, (yield from read_in_flight(session)), writer)
        if control.stop_requested:
            break
        if control.paused:
            yield RunPaused(session.step)
            control.wait_while_paused()
            if control.stop_requested:
                break
            yield RunResumed(session.step)
        if requested is not None:
            session.speed.apply(requested)
            session.recovery.forget(USER_SET)  # what the user asked for replaces what a shortage lowered
            yield SpeedChanged(session.step, session.speed.state())
        session.ranks.inject_fault(session.step + 1)
        yield from climb_back(session)  # a setting lowered for memory, once good steps left room
        before = session.speed.state()
        yield from _reported(session, (yield from train_step(session)), writer)
        after = session.speed.state()
        if after != before:  # decided at the first batch or for longer rows, or step graphs' trial
            yield SpeedChanged(session.step, after)
        if session.in_flight is not None and _due(session, session.step + 1):
            yield from _reported(session, (yield from read_in_flight(session)), writer)  # evaluate, save weights
    yield from _reported(session, (yield from read_in_flight(session)), writer)
    stopped_early = session.eval_watch.stopping
    cancelled = session.step < session.total_steps and not stopped_early
    yield from _finish(session, time.perf_counter() - started, cancelled, writer)


def _due(session: Session, step: int) -> bool:
    """Whether ``step`` ends the run or is followed by an evaluation or a checkpoint."""
    return step >= session.total_steps or _every(session, step, "eval_every") or _every(session, step, "save_every")


def _every(session: Session, step: int, setting: str) -> bool:
    """Whether ``training.<setting>`` (eval_every, save_every) falls on ``step`` before the run's last step."""
    every = getattr(session.config.training, setting)
    return bool(every) and step % every == 0 and step < session.total_steps


def _reported(session: Session, done: list[StepMetrics], writer: BestAdapterWriter | None) -> Iterator[Event]:
    """Log and yield the metrics of steps read back, then evaluate and save where one of them is due."""
    for metrics in done:
        # the driver's view once per step, as it is read back (one NVML call; None where NVML cannot tell)
        metrics = dataclasses.replace(metrics, driver_memory_bytes=vram.driver_bytes(session.device))
        if session.ranks.is_main:
            append_jsonl(session.run_dir / METRICS_FILE, _metrics_record(metrics))
        yield metrics
        yield from session.method.after_step(metrics.step)
        if _every(session, session.step, "eval_every"):
            yield from _evaluate(session, writer)
        if _every(session, session.step, "save_every"):
            yield _save_checkpoint(session)


def _evaluate(session: Session, writer: BestAdapterWriter | None) -> Iterator[Event]:
    """Evaluate on the held-out rows; a new lowest loss keeps the adapter as the best, rises are reported."""
    for event in evaluate(session):
        yield event
        if isinstance(event, EvalMetrics):
            yield from _watch(session, event, writer)


def _watch(session: Session, event: EvalMetrics, writer: BestAdapterWriter | None) -> Iterator[Event]:
    watch = session.eval_watch
    verdict = watch.observe(event.step, event.loss)
    if verdict.improved:
        gathered = session.ranks.full_trainable_state(session.model)  # a collective under FSDP2: every rank
        if writer is not None:
            weights = host_copy(session.model, gathered)
            writer.write(session.model, session.tokenizer, weights, event.step, event.loss)
        yield BestAdapterKept(event.step, event.loss, str(session.run_dir / BEST_ADAPTER_DIR))
    if verdict.warn:
        assert watch.best_step is not None and watch.best_loss is not None
        message = watch.rising_message(event.step, event.loss)
        yield EvalRising(event.step, event.loss, verdict.rises, watch.best_step, watch.best_loss, message)
    if verdict.stop:
        yield Notice(watch.stop_message())


def _finish(session: Session, wall_time: float, cancelled: bool, writer: BestAdapterWriter | None) -> Iterator[Event]:
    watch = session.eval_watch
    if not cancelled and watch.last_step != session.step:  # an early stop has just evaluated this step
        yield from _evaluate(session, writer)
    yield _save_checkpoint(session)
    adapter_dir = session.run_dir / ADAPTER_DIR
    gathered = session.ranks.full_trainable_state(session.model)
    if session.ranks.is_main:
        assert writer is not None
        writer.wait()  # the best adapter is on disk before the run says it finished
        try:
            with own_tree(session.model):  # peft finds its LoRA layers by class, never behind a speed stand-in
                save_adapter(session.model, session.tokenizer, adapter_dir, gathered)
        except OSError as err:
            raise ckpt.write_error(err, "final adapter", adapter_dir) from err
    session.ranks.barrier()
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


def _save_checkpoint(session: Session) -> CheckpointSaved:
    from peft import get_peft_model_state_dict

    state = ckpt.TrainerState(
        session.step, session.micro_batches, len(session.data.train_rows), session.total_steps, session.tokens_per_batch
    )
    ranks = session.ranks
    with own_tree(session.model):  # peft keeps the entries of the LoRA layers it finds by class
        adapter = get_peft_model_state_dict(session.model, state_dict=ranks.full_trainable_state(session.model))
    optimizer = ranks.checkpoint_optimizer(session.optimizer)  # gathered whole under FSDP2 (a collective)
    path = session.run_dir / CHECKPOINT_DIR / ckpt.checkpoint_name(session.step)
    if ranks.is_main:
        for log in (METRICS_FILE, EVAL_FILE):  # a durable checkpoint must not outlive the log lines before it
            ckpt.fsync_file(session.run_dir / log)
        path = ckpt.save_checkpoint(
            session.run_dir / CHECKPOINT_DIR,
            state,
            adapter,
            optimizer,
            session.scheduler,
            session.config.output.keep_checkpoints,
            reference=session.method.kept_state(),
        )
    ranks.barrier()  # nobody goes on before the checkpoint is whole
    return CheckpointSaved(session.step, str(path))


def _metrics_record(metrics: StepMetrics) -> dict[str, Any]:
    record = metrics.to_dict()
    record.pop("kind")
    return record
