"""Automatic run settings that fit the data: how long to train, what to hold out, how often to evaluate, the
learning rate and the adapter's size, from the dataset, the model and the method.

Most hobbyist datasets hold tens to a few thousand examples. One pass over 70 chats is a handful of optimizer
steps, too few for a model to learn anything visible (measured on SmolLM2-135M-Instruct: the answer format on 0 of
30 unseen questions after the old default of one epoch); ten passes at a high learning rate learn the format and
lose most of the facts the base model knew. So a small set gets several passes and a held-out split large enough
to choose the best adapter on, evaluated often enough that the best adapter and early stopping mean something,
and the base model's own answers to general prompts mixed in (``keep_knowledge``) so that it keeps what it knew. A
large set gets one pass, capped so that it never takes days.

:func:`fit_to_data` is pure: facts in, a frozen :class:`DataFit` with a reason for every choice out.
:func:`apply_fit` fills only the settings the user left automatic (0, or None, in the config): an explicit flag
always wins. Qt-free and torch-free: the app's Recipe page asks the same function what a run will do.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from engine.config import TOO_FEW_TO_HOLD_OUT, DataConfig, RunConfig, TrainingConfig, held_out_count

SMALL_SET = 2_000
"""Below this many training examples a set is small: several passes, and the base's answers mixed in."""
TARGET_VISITS = 480
"""A small set is trained until each of its examples was seen about this many times over, in all (480 / 60
examples: 8 passes), which taught every task of benchmarks/outcome_cpu.md; at most :data:`MAX_EPOCHS`."""
MAX_EPOCHS = 8.0
MIN_STEPS = 30
"""Fewer optimizer steps than this learn nothing visible whatever the data (the old default's 20 steps)."""
MAX_STEPS = 3_000
"""A large set trains for at most this many steps (one pass of a larger set is cut there, and says so)."""
EVALUATIONS = 15
"""Evaluations over a run: often enough that the best adapter is near the best step, cheap on held-out sets."""
PATIENCE = 4
"""Early stopping: evaluations in a row without a lower held-out loss before the run ends."""
WARMUP_SHARE = 0.05
MAX_WARMUP = 100
REPLAY_SHARE = 0.5
"""Replay examples (the base model's own answers to general prompts) per training example, for a small set."""
MIN_REPLAY, MAX_REPLAY = 16, 192
MEMORY_RANK = 16
"""The rank memory is planned for while the rank is still automatic (the larger of the common choices)."""


@dataclass(frozen=True)
class FitFacts:
    """What the choice depends on."""

    examples: int
    """Usable examples in the dataset (before any held-out split)."""
    tokens: int
    """Their tokens in all (prompt and answer)."""
    separate_held_out: bool
    """The held-out examples come from their own file (``eval_path``): nothing is split off."""
    parameters: int | None
    """The base model's parameters (None: unknown)."""
    instruct: bool
    """The model is instruction-tuned (it has a chat template): its own answers are worth keeping."""
    method: str
    tokens_per_batch: int
    grad_accum: int = 1


@dataclass(frozen=True)
class DataFit:
    """Every automatic choice, with why."""

    eval_fraction: float
    held_out: int
    max_steps: int
    epochs: float
    eval_every: int
    early_stop: int
    warmup_steps: int
    learning_rate: float
    lora_rank: int
    lora_alpha: float
    keep_knowledge: bool
    replay_examples: int
    rows_per_epoch: int
    """Packed rows of one pass (estimated from the tokens): what a pass count the user gave comes to in steps."""
    reasons: tuple[tuple[str, str], ...]
    """(setting, why) in the order they are printed."""


def epochs_for(train_examples: int, method: str) -> float:
    """Passes over the data: enough visits for a small set to be learned, one pass for a large one."""
    visits = TARGET_VISITS / 2 if method == "dpo" else TARGET_VISITS  # preferences move a model that answers
    return float(min(MAX_EPOCHS, max(1.0, round(visits / max(train_examples, 1)))))


def learning_rate_for(parameters: int | None, method: str) -> float:
    """Larger models take smaller steps; preference tuning a quarter of supervised tuning's."""
    size = parameters or 1_000_000_000
    rate = 3e-4 if size < 1e9 else 2e-4 if size < 1.5e10 else 1e-4
    return rate / 4 if method == "dpo" else rate


def rank_for(train_examples: int, parameters: int | None) -> int:
    """A small set needs few directions, and a smaller adapter forgets less; large sets and models get more."""
    if train_examples < 300:
        return 8
    if train_examples >= 20_000 and (parameters or 0) >= 3e9:
        return 32
    return 16


def replay_count(train_examples: int) -> int:
    return min(MAX_REPLAY, max(MIN_REPLAY, round(train_examples * REPLAY_SHARE)))


def fit_to_data(facts: FitFacts) -> DataFit:
    """The automatic settings for a run with these facts."""
    held_out = 0 if facts.separate_held_out else held_out_count(facts.examples)
    train = max(facts.examples - held_out, 1)
    keep = facts.method == "sft" and facts.instruct and train < SMALL_SET
    replay = replay_count(train) if keep else 0
    epochs = epochs_for(train, facts.method)
    tokens_per_example = facts.tokens / max(facts.examples, 1)
    rows = math.ceil((train + replay) * tokens_per_example / max(facts.tokens_per_batch, 1) / 0.9)
    raw_steps = math.ceil(epochs * max(rows, 1) / facts.grad_accum)
    steps = min(MAX_STEPS, max(MIN_STEPS, raw_steps))
    has_eval = facts.separate_held_out or held_out > 0
    eval_every = max(1, math.ceil(steps / EVALUATIONS)) if has_eval else 0
    rank = rank_for(train, facts.parameters)
    rate = learning_rate_for(facts.parameters, facts.method)
    warmup = min(MAX_WARMUP, max(1, round(steps * WARMUP_SHARE)))
    reasons = (
        ("held out", _held_out_reason(facts, held_out)),
        ("steps", _steps_reason(train, epochs, steps, raw_steps)),
        ("evaluate", f"every {eval_every} steps, about {EVALUATIONS} times" if eval_every else "only at the end"),
        ("early stop", f"after {PATIENCE} evaluations without a lower held-out loss" if has_eval else "off"),
        ("learning rate", _rate_reason(rate, facts)),
        ("adapter", f"rank {rank}, alpha {2 * rank}: " + _rank_reason(train, rank)),
        ("keep knowledge", _keep_reason(facts, train, replay)),
    )
    return DataFit(
        eval_fraction=held_out / facts.examples if held_out else 0.0,
        held_out=held_out,
        max_steps=steps,
        epochs=epochs,
        eval_every=eval_every,
        early_stop=PATIENCE if has_eval else 0,
        warmup_steps=warmup,
        learning_rate=rate,
        lora_rank=rank,
        lora_alpha=2.0 * rank,
        keep_knowledge=keep,
        replay_examples=replay,
        rows_per_epoch=max(rows, 1),
        reasons=reasons,
    )


def _held_out_reason(facts: FitFacts, held_out: int) -> str:
    if facts.separate_held_out:
        return "the held-out file"
    if held_out == 0:
        return f"none: {facts.examples} examples are too few to spare any (fewer than {TOO_FEW_TO_HOLD_OUT})"
    return f"{held_out} of {facts.examples} examples, enough to choose the best adapter on"


def _steps_reason(train: int, epochs: float, steps: int, raw: int) -> str:
    if steps == MAX_STEPS and raw > MAX_STEPS:
        return f"{steps} (capped: {epochs:g} pass(es) of {train} examples would take {raw}; --epochs 1 for all)"
    passes = f"{epochs:g} passes over {train} examples" if epochs > 1 else f"one pass over {train} examples"
    if steps == MIN_STEPS and raw < MIN_STEPS:
        return f"{steps}: {passes} is only {raw} steps, too few to learn from"
    return f"{steps}: {passes}" + (", so a small set is learned" if epochs > 1 else "")


def _rate_reason(rate: float, facts: FitFacts) -> str:
    size = f"{facts.parameters / 1e9:.2g}B parameters" if facts.parameters else "a model of unknown size"
    extra = ", a quarter for preference tuning" if facts.method == "dpo" else ""
    return f"{rate:g} for {size}{extra}"


def _rank_reason(train: int, rank: int) -> str:
    if rank == 8:
        return f"{train} examples need few directions, and a small adapter forgets less"
    return "the usual size"


def _keep_reason(facts: FitFacts, train: int, replay: int) -> str:
    if replay:
        return f"on: {replay} of the base model's own answers to general prompts are mixed in, so it keeps what it knew"
    if facts.method != "sft":
        return f"off: {facts.method} runs keep the base close by their own loss"
    if not facts.instruct:
        return "off: the model is not instruction-tuned (no chat template), so its answers are not worth keeping"
    return f"off: {train} examples are a large set (from {SMALL_SET})"


def apply_fit(config: RunConfig, fit: DataFit) -> tuple[RunConfig, list[str]]:
    """``config`` with every automatic setting (0 or None) set from ``fit``, and a line for each, saying why;
    settings the user gave are kept and not listed."""
    data, training, lora = config.data, config.training, config.lora
    chosen: dict[str, str] = dict(fit.reasons)
    lines: list[str] = []
    if data.eval_fraction is None:
        data = dataclasses.replace(data, eval_fraction=0.0 if data.eval_path else fit.eval_fraction)
        lines.append(f"held out: {chosen['held out']}")
    if training.max_steps == 0 and training.epochs == 0:
        training = dataclasses.replace(training, max_steps=fit.max_steps)
        lines.append(f"steps: {chosen['steps']}")
    training, more = _fill_training(training, fit, chosen, data)
    lines += more
    if lora.rank == 0:
        lora = dataclasses.replace(lora, rank=fit.lora_rank, alpha=lora.alpha or fit.lora_alpha)
        lines.append(f"adapter: {chosen['adapter']}")
    elif lora.alpha == 0:
        lora = dataclasses.replace(lora, alpha=2.0 * lora.rank)
    return dataclasses.replace(config, data=data, training=training, lora=lora), lines


def _fill_training(
    training: TrainingConfig, fit: DataFit, chosen: dict[str, str], data: DataConfig
) -> tuple[TrainingConfig, list[str]]:
    lines: list[str] = []
    changes: dict[str, object] = {}
    has_eval = bool(data.eval_path) or bool(data.eval_fraction)
    steps = training.max_steps or fit.max_steps
    if training.max_steps == 0 and training.epochs > 0:  # passes the user gave
        steps = max(1, math.ceil(training.epochs * fit.rows_per_epoch / training.grad_accum))
    if training.eval_every is None:
        changes["eval_every"] = max(1, math.ceil(steps / EVALUATIONS)) if has_eval else 0
        lines.append(f"evaluate: {chosen['evaluate']}" if has_eval else "evaluate: only at the end (nothing held out)")
    if training.early_stop is None:
        evaluates = has_eval and changes.get("eval_every", training.eval_every) != 0
        changes["early_stop"] = PATIENCE if evaluates else 0
        why = (
            chosen["early stop"] if evaluates else "off (nothing held out)" if not has_eval else "off (no evaluations)"
        )
        lines.append(f"early stop: {why}")
    if training.warmup_steps is None:
        changes["warmup_steps"] = min(MAX_WARMUP, max(1, round(steps * WARMUP_SHARE)))
    if training.learning_rate == 0:
        changes["learning_rate"] = fit.learning_rate
        lines.append(f"learning rate: {chosen['learning rate']}")
    if training.keep_knowledge is None:
        changes["keep_knowledge"] = fit.keep_knowledge
        lines.append(f"keep knowledge: {chosen['keep knowledge']}")
    return dataclasses.replace(training, **changes), lines  # type: ignore[arg-type]
