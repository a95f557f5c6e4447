"""Starting a run: the :class:`Session` it holds while it trains, built fresh or restored from a checkpoint.

:func:`start` seeds, prepares the data, loads the base model with a fresh LoRA adapter, spreads it over the
ranks (:class:`~engine.run.ranks.Ranks`), builds the optimizer, schedule and speed controller, and restores the
newest whole checkpoint when resuming (damaged ones are skipped with a notice).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine import method_facts as facts
from engine.config import RunConfig
from engine.data.prepare import PreparedData, RowSchedule
from engine.errors import ConfigError
from engine.events import Event, Notice, RunStarted, SpeedChanged
from engine.hardware import allocator
from engine.hardware.fit_to_data import replay_count
from engine.hardware.row_lengths import cpu_step_seconds
from engine.model.adapter import adapter_folder, adapter_lora, load_adapter_weights
from engine.model.gguf_import import prepare_gguf_model
from engine.model.load import add_lora, count_parameters, load_base_model, load_tokenizer, pick_device, pick_dtype
from engine.model.quantized_experts import experts_notice
from engine.run import checkpoint as ckpt
from engine.run import cpu_pace, guard, readout
from engine.run.anchor import BATCH_SIZE, KnowledgeAnchor, anchor_rows
from engine.run.best import EvalWatch
from engine.run.estimate import cpu_run_seconds
from engine.run.fit import fit_run
from engine.run.folder import CHECKPOINT_DIR, EVAL_FILE, METRICS_FILE, truncate_log, write_compute
from engine.run.methods.base import TrainingMethod
from engine.run.optimizer import adamw
from engine.run.ranks import Ranks
from engine.run.registry import Registry, RegistryError, data_dir
from engine.run.replay import as_examples, read_replay, replay_rows
from engine.run.rows import model_shape, resolve_rows
from engine.run.schedule import lr_lambda
from engine.speed import SpeedController
from engine.speed.reuse import DecisionStore, use_compile_cache
from engine.speed.stand_in import own_tree
from engine.speed.warm_up import RunLength

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
    method: TrainingMethod
    """What the run's training method does in its steps, evaluations and checkpoints (engine.run.methods)."""
    step: int = 0
    micro_batches: int = 0
    schedule: RowSchedule = field(init=False)
    last_loss: float | None = None
    last_eval: float | None = None
    tokens_per_batch: int = field(init=False)
    """Largest micro-batch in tokens; lowered after an out-of-memory step (rows are then split, never reordered)."""
    offload_tried: bool = False
    chunks_tried: bool = False
    """The per-token modules were switched to chunks after running out of memory."""
    non_finite: guard.NonFiniteCounter = field(init=False)
    recovery: guard.Recovery = field(init=False)
    """What out-of-memory steps lowered, and when to try it again."""
    ranks: Ranks = field(default_factory=Ranks.single)
    loss_module: torch.nn.Module | None = None
    """DDP around the model, or the FSDP2 root; None in a one-process run."""
    late_readout: bool = False
    """Each step's loss and gradient norm are read one step late (engine.run.readout)."""
    in_flight: readout.InFlight | None = None
    """With late readout: the step queued last, whose values the host has not read yet."""
    anchor: KnowledgeAnchor | None = None
    """The penalty on drifting from the base model on general prompts, added to every step (engine.run.anchor)."""
    eval_watch: EvalWatch = field(init=False)
    """The held-out losses so far: where the best adapter comes from, rises in a row, early stopping."""

    def __post_init__(self) -> None:
        self.eval_watch = EvalWatch(self.config.training.early_stop or 0)
        self.schedule = RowSchedule(len(self.data.train_rows), self.config.training.seed)
        self.tokens_per_batch = self.config.data.tokens_per_batch
        self.non_finite = guard.NonFiniteCounter(self.config.training.max_bad_steps)
        self.recovery = guard.Recovery(climb_after=guard.CLIMB_AFTER)

    @property
    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def start(
    config: RunConfig,
    run_dir: Path,
    resuming: bool,
    method: TrainingMethod,
    ranks: Ranks | None = None,
    device: torch.device | None = None,
) -> Generator[Event, None, Session]:
    """The session of a run of ``method`` (engine.run.methods.method_for(config.training.method))."""
    ranks = ranks or Ranks.single()
    _seed_everything(config.training.seed)
    device = device or pick_device(config.training.device)
    dtype = pick_dtype(config.model.dtype, device)
    config = yield from _fit_to_ranks(config, ranks, device, dtype)
    refusals = method.facts.refusals
    if ranks.distributed and facts.SEVERAL_GPUS in refusals:
        raise ConfigError(refusals[facts.SEVERAL_GPUS], hint="pass --gpus 1")
    yield from prepare_gguf_model(config.model.name, dtype, config.model.qlora)
    tokenizer = load_tokenizer(config.model)
    instruct = bool(getattr(tokenizer, "chat_template", None))  # before a fallback template is given
    owner_dir = None if resuming or not ranks.is_main else run_dir
    config = yield from resolve_rows(config, tokenizer, device, owner_dir, method.longest_document)
    config = (
        yield from fit_run(config, tokenizer, instruct, owner_dir, method.dataset_size)
        if not resuming
        else _resumed(config)
    )
    data = method.prepare(config.data, tokenizer, config.training.seed)
    _check_early_stop(config, data)
    for message in data.notices:
        yield Notice(message)
    if config.model.allow_pickle_weights:
        yield Notice(PICKLE_WARNING)
    # FSDP2 shards from host memory, so a model too big for one card never lands whole on one
    load_device = torch.device("cpu") if ranks.mode == "fsdp" else device
    model = yield from _with_adapter(config, load_base_model(config.model, load_device, dtype))
    if config.training.keep_knowledge and facts.KEEP_KNOWLEDGE not in refusals:
        data = yield from _with_replay(config, run_dir, tokenizer, model, load_device, data, ranks, method)
    experts_message = experts_notice(model)
    if experts_message is not None:
        yield Notice(experts_message)
    allocator_warning = allocator.check(device).warning  # with the weights on the GPU, its segments tell
    if allocator_warning is not None:
        yield Notice(allocator_warning)
    model.train()
    trainable, total = count_parameters(model)
    ranks.shard_layers(model, device)
    loss_module = ranks.wrap(model, device)
    use_compile_cache(data_dir())  # before anything compiles: kernels a run of this model compiled before load
    session = _make_session(config, run_dir, device, dtype, tokenizer, model, data, method)
    if ranks.is_main:
        write_compute(run_dir, dtype, device)
    session.ranks, session.loss_module = ranks, loss_module
    session.anchor = yield from _knowledge_anchor(session)
    session.late_readout, readout_reason = readout.resolve(
        config.training.step_readout, session.optimizer, ranks.distributed, session.scaler is not None
    )
    yield from _refuse_switches(session, readout_reason)
    yield from method.begin(session)
    graphs_refused = _step_graphs_refused(session)
    if graphs_refused is not None:
        session.speed.refuse_step_graphs(graphs_refused)
    if resuming:
        yield from _restore(session)
    session.speed.expect(expected_run(session), DecisionStore.in_folder(data_dir(), writable=ranks.is_main))
    estimated_s, estimate_basis = _expected_time(session)
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
        estimated_s=estimated_s,
        estimate_basis=estimate_basis,
    )
    state = session.speed.state()
    yield SpeedChanged(session.step, state)
    note = warm_up_note(state)
    if note is not None:
        yield Notice(note)
    return session


def _knowledge_anchor(session: Session) -> Generator[Event, None, KnowledgeAnchor | None]:
    """The run's knowledge anchor, over the replay rows in its folder; None when the penalty is off."""
    training = session.config.training
    weight = training.knowledge_penalty or 0.0
    if not training.keep_knowledge or weight <= 0 or facts.KEEP_KNOWLEDGE in session.method.facts.refusals:
        return None
    if session.ranks.distributed:
        yield Notice("knowledge penalty: off, it runs in one process only (the replay rows still keep knowledge)")
        return None
    rows = anchor_rows(session.tokenizer, read_replay(session.run_dir) or [])
    if not rows:
        return None
    yield Notice(f"knowledge penalty {weight:g}: each step keeps the answers to {BATCH_SIZE} general prompts near "
                 f"the base model's ({len(rows)} prompts in turn)")  # fmt: skip
    return KnowledgeAnchor(rows, weight, pad_token_id(session.tokenizer), session.device)


def pad_token_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad or 0)


def _resumed(config: RunConfig) -> Generator[Event, None, RunConfig]:
    """A run folder from before knowledge keeping (or its penalty) was a setting trains on as it did: without it."""
    training = config.training
    if training.keep_knowledge is None or training.knowledge_penalty is None:
        kept = dataclasses.replace(
            training,
            keep_knowledge=bool(training.keep_knowledge),
            knowledge_penalty=training.knowledge_penalty or 0.0,
        )
        config = dataclasses.replace(config, training=kept)
    yield from ()
    return config


def _with_replay(
    config: RunConfig,
    run_dir: Path,
    tokenizer: Any,
    model: Any,
    device: torch.device,
    data: PreparedData,
    ranks: Ranks,
    method: TrainingMethod,
) -> Generator[Event, None, PreparedData]:
    """``data`` with the base model's answers to general prompts in its training rows (engine.run.replay): made by
    the first process, sent to the others."""
    wanted = replay_count(len(data.train), config.training.knowledge_share)
    rows: list[dict[str, str]] | None = None
    if ranks.is_main:
        rows = yield from replay_rows(model, tokenizer, device, wanted, config.training.seed, run_dir, write=True)
    rows = ranks.broadcast_object(rows) or []  # sent, not read from the folder: another computer has none
    extra = as_examples(rows[:wanted])
    yield Notice(f"keep knowledge: {len(extra)} of the base model's own answers join {len(data.train)} examples")
    return method.prepare(config.data, tokenizer, config.training.seed, extra_train=extra)


def _expected_time(session: Session) -> tuple[float | None, str]:
    """The training time the run expects before its first step, and what it rests on: on a CPU, a timed training
    pass of one row (engine.run.cpu_pace), or the planner's step time for the model and its rows where a pass would
    take too long or the run spans processes (a GPU run's time is known after its first steps)."""
    if session.device.type != "cpu":
        return None, ""
    shape = model_shape(session.config.model)
    if shape is None:
        return None, ""
    config = session.config
    threads, qlora = torch.get_num_threads(), config.model.qlora
    planned_s = cpu_step_seconds(shape, session.tokens_per_batch, threads, qlora)
    step_s, basis = planned_s, "from the planner's figure for this CPU"
    if 0 < planned_s <= cpu_pace.MEASURE_UP_TO_S and not session.ranks.distributed:  # ranks' passes would wait
        vocab = int(session.model.get_input_embeddings().num_embeddings)
        step_s = cpu_pace.training_pass_seconds(session.model, session.tokens_per_batch, vocab)
        basis = "from a timed training pass on this CPU"
    anchor_tokens = round(session.anchor.tokens_per_step()) if session.anchor is not None else 0
    anchor_s = cpu_step_seconds(shape, anchor_tokens, threads, qlora) * step_s / planned_s if anchor_tokens else 0.0
    left = session.total_steps - session.step
    seconds = cpu_run_seconds(
        step_s, left, config.training.grad_accum, len(session.data.eval_rows), config.training.eval_every or 0, anchor_s
    )
    return seconds, basis


def _check_early_stop(config: RunConfig, data: PreparedData) -> None:
    """Early stopping watches the held-out loss: a run without held-out examples is refused before loading."""
    if config.training.early_stop and not data.eval:
        raise ConfigError(
            "--early-stop needs held-out examples to watch, and this run has none",
            hint="hold some out (--eval-fraction 0.1, or --eval-path FILE), or leave --early-stop at 0",
        )


def _with_adapter(config: RunConfig, base: Any) -> Generator[Event, None, Any]:
    """``base`` with a fresh LoRA adapter, or with the one ``model.adapter`` names (a resumed run's checkpoint then
    replaces its weights, where the run has one)."""
    if config.model.adapter is None:
        return add_lora(base, config.lora, config.model.qlora)
    folder = starting_adapter_folder(config.model.adapter)
    lora = adapter_lora(folder, config.lora)
    model = add_lora(base, lora, config.model.qlora)
    load_adapter_weights(model, folder)
    yield Notice(f"starting from the adapter in {folder} (rank {lora.rank}, alpha {lora.alpha:g})")
    return model


def starting_adapter_folder(reference: str, which: str = "best") -> Path:
    """The adapter folder that ``model.adapter`` names (a folder, or a run by id or name in the run history, whose
    best adapter is taken unless ``which`` is ``last``)."""
    return adapter_folder(_adapter_location(reference), which)


def _adapter_location(reference: str) -> Path:
    """A folder as given, or the folder of the run with that id or name in the run history."""
    path = Path(reference).expanduser()
    if path.exists():
        return path
    try:
        return Path(Registry().resolve(reference).folder)
    except RegistryError as err:
        raise ConfigError(f"--adapter {reference}: no such folder, and {err.message}", err.hint) from err
    except OSError as err:
        raise ConfigError(f"--adapter {reference}: no such folder, and the run history cannot be read: {err}") from err


def _refuse_switches(session: Session, readout_reason: str) -> Iterator[Event]:
    """Turn off the switches the run's method cannot train with (engine.method_facts), saying why where the user
    asked for one."""
    refusals = session.method.facts.refusals
    if facts.STEP_GRAPHS in refusals:
        session.speed.refuse_step_graphs(refusals[facts.STEP_GRAPHS])
    if facts.FUSED_LOSS in refusals:
        session.speed.refuse_fused_loss(refusals[facts.FUSED_LOSS])
    asked_late = session.config.training.step_readout == "late"
    if facts.LATE_READOUT in refusals:
        if session.late_readout or asked_late:
            session.late_readout = False
            yield Notice(f"step readout: every step before its update ({refusals[facts.LATE_READOUT]})")
    elif asked_late and not session.late_readout:
        yield Notice(readout_reason)


def expected_run(session: Session) -> RunLength:
    """What is left of the run for the speed controller: steps, this process's micro-batches a step and the longest
    packed row's tokens (switches with a one-off cost pay it back only over enough of them)."""
    data = session.data
    longest = max((sum(len(data.train[i]) for i in row) for row in data.train_rows), default=0)
    per_step = math.ceil(session.config.training.grad_accum / session.ranks.world)
    return RunLength(session.total_steps - session.step, per_step, min(longest, session.tokens_per_batch))


def warm_up_note(state: dict[str, Any]) -> str | None:
    """What the first steps spend on one-off work, for switches that do some (None: nothing to wait for)."""
    compiles = bool(state.get("fused_kernels", {}).get("on"))
    graphs = state.get("step_graphs", {})
    on_trial = bool(graphs.get("on")) and "trying" in str(graphs.get("reason", ""))
    if not (compiles or on_trial):
        return None
    work = []
    if compiles:
        work.append("compile this model's fused GPU kernels (50-90 s for an 8B model on an H200)")
    if on_trial:
        work.append("time step graphs against eager steps")
    return f"the first steps {' and '.join(work)}; the steps after them run at full speed"


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
    config: RunConfig,
    run_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    tokenizer: Any,
    model: Any,
    data: Any,
    method: TrainingMethod,
) -> Session:
    params = [p for p in model.parameters() if p.requires_grad]
    training = config.training
    optimizer = adamw(params, training.learning_rate, training.weight_decay, training.optimizer, device)
    total_steps = method.total_steps(config, len(data.train_rows))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(config.training.schedule, config.training.warmup_steps or 0, total_steps)
    )
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 and device.type == "cuda" else None
    speed = SpeedController(model, config.speed, device)
    return Session(
        config, run_dir, device, dtype, tokenizer, model, data, optimizer, scheduler, scaler, speed, total_steps, method
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
    yield from session.method.after_restore(session)
    if session.tokens_per_batch < session.config.data.tokens_per_batch:
        yield Notice(
            f"micro-batches stay at {session.tokens_per_batch} tokens, as lowered after running out of memory "
            f"(data.tokens_per_batch is {session.config.data.tokens_per_batch})"
        )
    if session.ranks.is_main:
        truncate_log(session.run_dir / METRICS_FILE, session.step)
        truncate_log(session.run_dir / EVAL_FILE, session.step)
    session.eval_watch = EvalWatch.resumed(
        session.config.training.early_stop or 0,
        _eval_losses(session.run_dir / EVAL_FILE, session.step),
        session.run_dir,
    )


def _eval_losses(path: Path, last_step: int) -> list[tuple[int, float]]:
    """(step, held-out loss) of each evaluation in ``eval.jsonl`` up to ``last_step`` (every rank reads the same,
    whether or not the first has cut the log back yet)."""
    losses = []
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    for line in lines:
        try:
            record = json.loads(line)
            step, loss = int(record["step"]), float(record["eval_loss"])
        except (ValueError, KeyError, TypeError):  # a torn last line
            continue
        if step <= last_step:
            losses.append((step, loss))
    return losses


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
    with own_tree(session.model):  # peft finds its LoRA layers by class, never behind a speed stand-in
        sharded = get_peft_model_state_dict(session.model) if session.ranks.mode == "fsdp" else {}
        weights = session.ranks.shard_like(sharded, {k: v.to(session.device) for k, v in weights.items()})
        set_peft_model_state_dict(session.model, weights)
    session.method.restore_state(ckpt.load_reference(checkpoint))
    session.step, session.micro_batches = state.step, state.micro_batches
    if 0 < state.tokens_per_batch < session.tokens_per_batch:  # memory ran short before: do not hit it again
        session.tokens_per_batch = state.tokens_per_batch
    return None


def _step_graphs_refused(session: Session) -> str | None:
    """Why this run's micro-batches cannot replay from CUDA graphs (None when they can)."""
    if session.loss_module is not None:
        return "several GPUs: DDP/FSDP hooks run in every backward"
    if session.scaler is not None:
        return "float16 loss scaling checks every step's gradients on the host"
    return None
