"""The training run: ``for event in run(config): ...``.

A run prepares the data, loads the base model with a fresh LoRA adapter (or restores one from a checkpoint),
then takes optimizer steps over packed rows, reporting each as an event. Between two steps it obeys its
:class:`~engine.control.RunControl` (stop, pause, new speed settings). Everything a user keeps lands in the
run folder: ``config.json``, ``metrics.jsonl``, ``eval.jsonl``, ``checkpoints/`` and the final ``adapter/``.
Failures end the iterator with a :class:`~engine.events.RunFailed` event instead of an exception.

Reliability (see engine.guard and engine.checkpoint): an out-of-memory step is retried with smaller micro-batches
or offloaded checkpointing; a non-finite loss skips the update; checkpoints, the adapter and config.json are
written atomically and the logs are fsynced before each checkpoint, so a kill at any moment resumes from a
consistent state; a failed write stops the run with a message naming the disk problem. Nothing a run reports
or writes contains the Hugging Face token (engine.redact).

Several GPUs (``training.gpus``): :func:`run` launches the ranks under torchrun (engine.distributed.launch) and
yields rank 0's events; each rank runs :func:`run_rank`, this same loop with its :class:`Ranks` share of every
step. engine.distributed says what a step means with W ranks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import time
import traceback
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from engine import checkpoint as ckpt
from engine import guard
from engine.config import RunConfig
from engine.control import RunControl
from engine.dataset import PreparedData, RowSchedule, prepare_data
from engine.distributed.launch import resolve_gpus, run_ranks
from engine.distributed.ranks import Ranks, plain_number
from engine.errors import ConfigError, TuneDeckError
from engine.events import (
    CheckpointSaved,
    EvalMetrics,
    Event,
    Notice,
    OomRecovered,
    RunFailed,
    RunFinished,
    RunPaused,
    RunResumed,
    RunStarted,
    SpeedChanged,
    StepMetrics,
    StepSkipped,
)
from engine.models import add_lora, count_parameters, load_base_model, load_tokenizer, pick_device, pick_dtype
from engine.packing import IGNORE_INDEX, PackedBatch, TokenizedExample, collate
from engine.redact import known_tokens, redact, redact_event
from engine.schedule import lr_lambda
from engine.speed import SpeedController

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
ADAPTER_DIR = "adapter"
CHECKPOINT_DIR = "checkpoints"
PICKLE_WARNING = (
    "pickle weights are allowed for this run: loading a .bin/.pt file can run code hidden in it; "
    "only do this for models from people you trust"
)


@dataclass
class Session:
    """Everything a run holds while it trains."""

    config: RunConfig
    run_dir: Path
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any
    model: Any
    data: PreparedData
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    speed: SpeedController
    total_steps: int
    step: int = 0
    micro_batches: int = 0
    schedule: RowSchedule = field(init=False)
    last_loss: float | None = None
    last_eval: float | None = None
    tokens_per_batch: int = field(init=False)
    """Largest micro-batch in tokens; lowered after an out-of-memory step (rows are then split, never reordered)."""
    offload_tried: bool = False
    non_finite: guard.NonFiniteCounter = field(init=False)
    ranks: Ranks = field(default_factory=Ranks.single)
    loss_module: torch.nn.Module | None = None
    """DDP around the model, or the FSDP2 root; None in a one-process run."""

    def __post_init__(self) -> None:
        self.schedule = RowSchedule(len(self.data.train_rows), self.config.training.seed)
        self.tokens_per_batch = self.config.data.tokens_per_batch
        self.non_finite = guard.NonFiniteCounter(self.config.training.max_bad_steps)

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def run(config: RunConfig, *, control: RunControl | None = None, resume: str | Path | None = None) -> Iterator[Event]:
    """Train a LoRA adapter, yielding events; ``resume`` continues the run in that folder from its last checkpoint."""
    tokens = known_tokens()
    for event in _run(config, control, resume):
        yield redact_event(event, tokens)


def _run(config: RunConfig, control: RunControl | None, resume: str | Path | None) -> Iterator[Event]:
    # Packed rows change length every step; without expandable segments the caching allocator fragments and
    # planned batches ran out of memory with up to 4.9 GiB reserved but unused (H200). Must precede CUDA init.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    control = control or RunControl()
    session: Session | None = None
    run_dir: Path | None = None
    try:
        if resume is not None:
            run_dir = Path(resume)
            config = _resumed_config(_load_run_config(run_dir), config)
        gpus = resolve_gpus(config.training.gpus, config.training.device)
        config = _on_one_gpu(config, gpus)
        if run_dir is None:
            run_dir = _new_run_dir(config)
        if len(gpus) > 1:
            yield from run_ranks(config, run_dir, resume is not None, gpus, control)
            return
        session = yield from _start(config, run_dir, resume is not None)
        yield from _train(session, control)
    except Exception as err:  # the user gets a message and a log, never a dead app
        yield _failure(err, session, run_dir, write_log=True)


def run_rank(
    config: RunConfig, run_dir: Path, resuming: bool, ranks: Ranks, device: torch.device, control: RunControl
) -> Iterator[Event]:
    """One rank of a multi-GPU run (started by engine.distributed.worker); only rank 0's events are shown."""
    tokens = known_tokens()
    session: Session | None = None
    try:
        session = yield from _start(config, run_dir, resuming, ranks, device)
        yield from _train(session, control)
    except Exception as err:
        yield redact_event(_failure(err, session, run_dir, write_log=ranks.is_main), tokens)


def _failure(err: Exception, session: Session | None, run_dir: Path | None, write_log: bool) -> RunFailed:
    step, folder = (session.step if session else 0), (str(run_dir) if run_dir else None)
    if isinstance(err, TuneDeckError):
        return RunFailed(err.message, err.hint, step, folder)
    log = _write_error_log(run_dir, err) if write_log else None
    return RunFailed(
        f"unexpected error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
        f"details are in {log}" if log else None,
        step,
        folder,
    )


def _resumed_config(saved: RunConfig, given: RunConfig) -> RunConfig:
    """A resumed run keeps its saved settings, except which GPUs it now runs on and how they share the model."""
    training = dataclasses.replace(saved.training, gpus=given.training.gpus, parallel=given.training.parallel)
    return dataclasses.replace(saved, training=training)


def _on_one_gpu(config: RunConfig, gpus: list[int]) -> RunConfig:
    """``--gpus 3`` style lists of one GPU train in this process on that GPU."""
    if len(gpus) != 1 or gpus[0] == 0 or config.training.device not in ("auto", "cuda"):
        return config
    training = dataclasses.replace(config.training, device=f"cuda:{gpus[0]}")
    return dataclasses.replace(config, training=training)


def _write_error_log(run_dir: Path | None, err: Exception) -> Path | None:
    if run_dir is None or not run_dir.exists():
        return None
    log = run_dir / "error.log"
    try:
        log.write_text(redact("".join(traceback.format_exception(err))), encoding="utf-8")
    except OSError:  # a full disk must not turn the failure report into a second failure
        return None
    return log


def _load_run_config(run_dir: Path) -> RunConfig:
    """The run's saved config; a damaged or hand-edited one is a ConfigError that names the file."""
    path = run_dir / CONFIG_FILE
    if not path.exists():
        raise ConfigError(f"{run_dir} is not a TuneDeck run folder (no {CONFIG_FILE})")
    try:
        return RunConfig.load(path)
    except RecursionError:
        raise ConfigError(f"{path} is nested too deeply to be a TuneDeck config") from None
    except ConfigError as err:
        if str(path) in err.message:
            raise
        raise ConfigError(f"{path}: {err.message}", err.hint) from err


def _new_run_dir(config: RunConfig) -> Path:
    parent = Path(config.output.dir).expanduser()
    name = config.output.name or _default_run_name(config)
    run_dir = parent / name
    if (run_dir / CONFIG_FILE).exists():
        if config.output.name:
            raise ConfigError(
                f"run folder {run_dir} already exists", hint="pass --resume to continue it, or another --name"
            )
        run_dir = parent / f"{name}-{random.randrange(16**4):04x}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.write_text_atomic(run_dir / CONFIG_FILE, json.dumps(config.to_dict(), indent=2) + "\n")
    except OSError as err:
        raise ckpt.write_error(err, "run folder", run_dir) from err
    return run_dir


def _default_run_name(config: RunConfig) -> str:
    model = Path(config.model.name).name or "model"
    data = Path(config.data.path).stem or "data"
    return f"{datetime.now():%Y%m%d-%H%M%S}-{model}-{data}"


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _total_steps(config: RunConfig, num_rows: int) -> int:
    if config.training.max_steps:
        return config.training.max_steps
    return max(1, math.ceil(config.training.epochs * num_rows / config.training.grad_accum))


def _start(
    config: RunConfig, run_dir: Path, resuming: bool, ranks: Ranks | None = None, device: torch.device | None = None
) -> Generator[Event, None, Session]:
    ranks = ranks or Ranks.single()
    _seed_everything(config.training.seed)
    device = device or pick_device(config.training.device)
    dtype = pick_dtype(config.model.dtype, device)
    config = yield from _fit_to_ranks(config, ranks, device, dtype)
    tokenizer = load_tokenizer(config.model)
    data = prepare_data(config.data, tokenizer, config.training.seed)
    for message in data.notices:
        yield Notice(message)
    if config.model.allow_pickle_weights:
        yield Notice(PICKLE_WARNING)
    # FSDP2 shards from host memory, so a model too big for one card never lands whole on one
    load_device = torch.device("cpu") if ranks.mode == "fsdp" else device
    model = add_lora(load_base_model(config.model, load_device, dtype), config.lora, config.model.qlora)
    model.train()
    trainable, total = count_parameters(model)
    ranks.shard_layers(model, device)
    loss_module = ranks.wrap(model, device)
    session = _make_session(config, run_dir, device, dtype, tokenizer, model, data)
    session.ranks, session.loss_module = ranks, loss_module
    if resuming:
        yield from _restore(session)
    yield RunStarted(
        run_dir=str(run_dir),
        device=_device_label(device, ranks),
        dtype=str(dtype).replace("torch.", ""),
        total_steps=session.total_steps,
        start_step=session.step,
        train_examples=len(data.train),
        eval_examples=len(data.eval),
        train_rows=len(data.train_rows),
        packing_efficiency=data.efficiency,
        trainable_params=trainable,
        total_params=total,
    )
    yield SpeedChanged(session.step, session.speed.state())
    return session


def _fit_to_ranks(
    config: RunConfig, ranks: Ranks, device: torch.device, dtype: torch.dtype
) -> Generator[Event, None, RunConfig]:
    """Say how the ranks share the model; FSDP2 needs every rank to run the same collectives in every step."""
    if not ranks.distributed:
        return config
    yield Notice(f"training on {ranks.world} processes with {ranks.mode.upper()}: {ranks.reason}")
    if ranks.mode != "fsdp":
        return config
    if dtype == torch.float16:
        raise ConfigError("FSDP2 with float16 loss scaling is not supported", hint="use --parallel ddp")
    if config.speed.checkpointing != "auto" or device.type != "cuda":
        return config
    # automatic checkpointing decides per GPU from its free memory; under FSDP2 a recompute gathers weights,
    # so ranks deciding differently would wait on each other forever
    yield Notice("FSDP2: activation checkpointing is fixed to standard recompute on every GPU")
    return dataclasses.replace(config, speed=dataclasses.replace(config.speed, checkpointing="standard"))


def _device_label(device: torch.device, ranks: Ranks) -> str:
    if not ranks.distributed:
        return str(device)
    return f"{device.type} ×{ranks.world} ({ranks.mode.upper()})"


def _make_session(
    config: RunConfig, run_dir: Path, device: torch.device, dtype: torch.dtype, tokenizer: Any, model: Any, data: Any
) -> Session:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.training.learning_rate, weight_decay=config.training.weight_decay)
    total_steps = _total_steps(config, len(data.train_rows))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(config.training.schedule, config.training.warmup_steps, total_steps)
    )
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 and device.type == "cuda" else None
    speed = SpeedController(model, config.speed, device)
    return Session(
        config, run_dir, device, dtype, tokenizer, model, data, optimizer, scheduler, scaler, speed, total_steps
    )


def _restore(session: Session) -> Iterator[Event]:
    """Continue from the newest whole checkpoint; damaged ones are skipped, none at all means starting over."""
    folder = session.run_dir / CHECKPOINT_DIR
    if session.ranks.is_main:
        ckpt.recover_interrupted(folder)
        ckpt.recover_interrupted(session.run_dir)
    session.ranks.barrier()
    for checkpoint in reversed(ckpt.list_checkpoints(folder)):
        problem = ckpt.checkpoint_problem(checkpoint)
        if problem is None:
            problem = _load_checkpoint(session, checkpoint)
        if problem is None:
            break
        yield Notice(f"checkpoint {checkpoint.name} was skipped: {problem}")
    else:
        yield Notice(f"{session.run_dir} has no usable checkpoint yet; training starts from the beginning")
    if session.tokens_per_batch < session.config.data.tokens_per_batch:
        yield Notice(
            f"micro-batches stay at {session.tokens_per_batch} tokens, as lowered after running out of memory "
            f"(data.tokens_per_batch is {session.config.data.tokens_per_batch})"
        )
    if session.ranks.is_main:
        _truncate_log(session.run_dir / METRICS_FILE, session.step)
        _truncate_log(session.run_dir / EVAL_FILE, session.step)


def _load_checkpoint(session: Session, checkpoint: Path) -> str | None:
    """Put the checkpoint's state into the session; returns why it could not be read instead of raising."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    state = ckpt.load_trainer_state(checkpoint)
    if state.train_rows != len(session.data.train_rows):
        raise ConfigError(
            f"the dataset changed since {checkpoint.name}: {len(session.data.train_rows)} packed rows, "
            f"the checkpoint was made with {state.train_rows}",
            hint="resume with the same dataset and data settings",
        )
    try:
        weights = ckpt.load_checkpoint(checkpoint, session.optimizer, session.scheduler)
    except Exception as err:  # safetensors, pickle and OS errors all mean "this one cannot be used"
        return f"it cannot be read ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    session.ranks.shard_optimizer_state(session.optimizer)
    sharded = get_peft_model_state_dict(session.model) if session.ranks.mode == "fsdp" else {}
    weights = session.ranks.shard_like(sharded, {k: v.to(session.device) for k, v in weights.items()})
    set_peft_model_state_dict(session.model, weights)
    session.step, session.micro_batches = state.step, state.micro_batches
    if 0 < state.tokens_per_batch < session.tokens_per_batch:  # memory ran short before: do not hit it again
        session.tokens_per_batch = state.tokens_per_batch
    return None


def _truncate_log(path: Path, last_step: int) -> None:
    """Drop records written after the checkpoint, so the resumed curve continues without duplicates."""
    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines() if _line_step(line) <= last_step]
    ckpt.write_text_atomic(path, "".join(line + "\n" for line in kept))


def _line_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a torn last line from a crash is dropped


def _train(session: Session, control: RunControl) -> Iterator[Event]:
    started = time.perf_counter()
    training = session.config.training
    while session.step < session.total_steps:
        control.sync()
        if control.stop_requested:
            break
        if control.paused:
            yield RunPaused(session.step)
            control.wait_while_paused()
            if control.stop_requested:
                break
            yield RunResumed(session.step)
        requested = control.take_speed_request()
        if requested is not None:
            session.speed.apply(requested)
            yield SpeedChanged(session.step, session.speed.state())
        session.ranks.inject_fault(session.step + 1)
        metrics = yield from _step(session)
        if metrics is None:  # skipped: non-finite loss or gradient
            continue
        if session.ranks.is_main:
            _append_jsonl(session.run_dir / METRICS_FILE, _metrics_record(metrics))
        yield metrics
        if training.eval_every and session.step % training.eval_every == 0 and session.step < session.total_steps:
            yield from _evaluate(session)
        if training.save_every and session.step % training.save_every == 0 and session.step < session.total_steps:
            yield _save_checkpoint(session)
    yield from _finish(session, time.perf_counter() - started, cancelled=session.step < session.total_steps)


def _finish(session: Session, wall_time: float, cancelled: bool) -> Iterator[Event]:
    if not cancelled:
        yield from _evaluate(session)
    yield _save_checkpoint(session)
    adapter_dir = session.run_dir / ADAPTER_DIR
    gathered = session.ranks.full_trainable_state(session.model)
    if session.ranks.is_main:
        try:
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
    )


def save_adapter(model: Any, tokenizer: Any, folder: Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the adapter in PEFT format (with the tokenizer) atomically; ``state_dict``: weights gathered by FSDP2."""
    tmp = folder.with_name(f".tmp-{folder.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True, **({"state_dict": state_dict} if state_dict else {}))
        tokenizer.save_pretrained(tmp)
        ckpt.commit_folder(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _save_checkpoint(session: Session) -> CheckpointSaved:
    from peft import get_peft_model_state_dict

    state = ckpt.TrainerState(
        session.step, session.micro_batches, len(session.data.train_rows), session.total_steps, session.tokens_per_batch
    )
    ranks = session.ranks
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
        )
    ranks.barrier()  # nobody goes on before the checkpoint is whole
    return CheckpointSaved(session.step, str(path))


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


@dataclass(frozen=True)
class StepTokens:
    """What a step trained on, over all ranks: tokens in its rows and tokens that count in the loss."""

    tokens: int
    trained: int


def _accumulate(session: Session, rows: list[int]) -> tuple[float, StepTokens]:
    """Forward and backward over the step's rows (this rank's share of them); the loss is the sum over trained
    tokens / their count over the whole step, this rank's part of it under several ranks."""
    data = session.data
    documents = [data.train[i] for r in rows for i in data.train_rows[r]]
    counted = StepTokens(sum(len(ex) for ex in documents), sum(ex.trained_tokens for ex in documents))
    per_row = [_row_groups(data.train, data.train_rows[r], session.tokens_per_batch) for r in rows]
    mine = _rank_batches(session, per_row)
    ranks = session.ranks
    total = torch.zeros((), device=session.device)
    for i, batch in enumerate(mine):
        with ranks.accumulating(session.loss_module, last=i == len(mine) - 1):
            loss = _forward_loss(session, batch, counted.trained)
            scaled = loss * ranks.loss_scale if ranks.distributed else loss
            (session.scaler.scale(scaled) if session.scaler is not None else scaled).backward()
        total += loss.detach().float()
    return float(total), counted


def _accumulate_or_lower(session: Session, rows: list[int]) -> Generator[Event, None, tuple[float, StepTokens]]:
    """Run the step's forward/backward, lowering memory use and retrying after each out-of-memory error."""
    while True:
        try:
            return _accumulate(session, rows)
        except Exception as err:
            if not guard.is_out_of_memory(err):
                raise
            if session.ranks.distributed:  # the other ranks are already waiting in this step's collectives
                raise guard.out_of_memory_error(session.step + 1, session.tokens_per_batch) from err
        # outside the except block: the traceback (and the activations its frames hold) is gone by now
        guard.release_memory(session.optimizer, session.device)
        yield from _lower_memory(session, [session.data.train_rows[r] for r in rows], session.data.train)


def _lower_memory(session: Session, rows: list[list[int]], examples: list[TokenizedExample]) -> Iterator[Event]:
    offloaded = session.speed.state().get("checkpointing", {}).get("mode") == "offloaded"
    longest = _longest_document(examples, rows)
    action = guard.next_oom_action(session.tokens_per_batch, longest, session.offload_tried or offloaded)
    if action is None:
        raise guard.out_of_memory_error(session.step + 1, session.tokens_per_batch)
    message = action.describe(session.tokens_per_batch)
    session.tokens_per_batch = action.tokens_per_batch
    yield OomRecovered(session.step + 1, action.kind, action.tokens_per_batch, message)
    if action.kind == guard.OFFLOADED_CHECKPOINTING:
        session.offload_tried = True
        session.speed.apply(dataclasses.replace(session.speed.settings, checkpointing="offloaded"))
        yield SpeedChanged(session.step, session.speed.state())


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
    session.optimizer.zero_grad(set_to_none=True)


def _is_bad_step(session: Session, loss: float, grad_norm: float) -> bool:
    # With fp16 loss scaling, inf gradients are the scaler's business: it skips the step and lowers the scale.
    return not math.isfinite(loss) or (session.scaler is None and not math.isfinite(grad_norm))


def _skip_update(session: Session, loss: float, grad_norm: float) -> StepSkipped:
    """Throw the step's gradients away; the weights, optimizer moments and learning-rate schedule stay as they were."""
    session.optimizer.zero_grad(set_to_none=True)
    if session.scaler is not None:
        session.scaler.update()
    counter = session.non_finite
    counter.bad(session.step + 1)
    return StepSkipped(session.step + 1, loss, grad_norm, counter.in_a_row, counter.total)


def _last_checkpoint(session: Session) -> str | None:
    found = ckpt.list_checkpoints(session.run_dir / CHECKPOINT_DIR)
    return str(found[-1]) if found else None


def _step(session: Session) -> Generator[Event, None, StepMetrics | None]:
    """One optimizer step over ``grad_accum`` packed rows; None when the update was skipped (non-finite)."""
    if session.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(session.device)
    start = time.perf_counter()
    learning_rate = float(session.scheduler.get_last_lr()[0])
    rows = _next_rows(session)
    loss_value, counted = yield from _accumulate_or_lower(session, rows)
    rank_memory: list[int] | None = None
    if session.ranks.distributed:  # one small all-reduce: the step's loss and every rank's peak memory
        loss_value, rank_memory = session.ranks.reduce_step(loss_value, _memory_bytes(session.device))
    grad_norm = _clip_gradients(session)
    if _is_bad_step(session, loss_value, grad_norm):
        yield _skip_update(session, loss_value, grad_norm)
        if session.non_finite.exhausted:
            raise session.non_finite.error(_last_checkpoint(session))
        return None
    session.non_finite.good()
    _optimizer_step(session)
    elapsed = time.perf_counter() - start
    session.step += 1
    session.last_loss = loss_value
    tokens = counted.tokens
    return StepMetrics(
        step=session.step,
        total_steps=session.total_steps,
        epoch=session.schedule.epoch(session.micro_batches),
        loss=loss_value,
        learning_rate=learning_rate,
        grad_norm=grad_norm,
        tokens=tokens,
        trained_tokens=counted.trained,
        step_time_s=elapsed,
        tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
        memory_bytes=max(rank_memory) if rank_memory else _memory_bytes(session.device),
        rank_memory_bytes=rank_memory,
    )


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import psutil

    return int(psutil.Process().memory_info().rss)


@torch.no_grad()
def evaluate_loss(session: Session) -> tuple[float, int] | None:
    """Mean loss per trained token over the held-out rows, or None without an eval split."""
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


def _evaluate(session: Session) -> Iterator[Event]:
    while True:
        try:
            result = evaluate_loss(session)
            break
        except Exception as err:
            if not guard.is_out_of_memory(err):
                raise
        guard.release_memory(session.optimizer, session.device)
        yield from _lower_memory(session, session.data.eval_rows, session.data.eval)
    if result is None:
        return
    loss, tokens = result
    session.last_eval = loss
    if session.ranks.is_main:
        _append_jsonl(session.run_dir / EVAL_FILE, {"step": session.step, "eval_loss": loss, "tokens": tokens})
    yield EvalMetrics(session.step, loss, tokens)


def _metrics_record(metrics: StepMetrics) -> dict[str, Any]:
    record = metrics.to_dict()
    record.pop("kind")
    return record


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """One write per record: a kill can only tear the last line, which resuming drops."""
    try:
        with path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
    except OSError as err:
        raise ckpt.write_error(err, f"training log {path.name}", path.parent) from err
