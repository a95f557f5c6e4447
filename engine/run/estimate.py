"""How long a run's training takes on this machine: before Start, while it runs, and how close that was.

Before Start the estimate comes from runs measured here: earlier runs of the same model and training method on
this GPU class (the same card first), their mean tokens/s over the steps they took, scaled to this run's steps (a
step's own time: pauses, loading and a later rename are not in it). Without such a run, TuneDeck's own measured
rows of the GPU class (:data:`MEASURED_ROWS`) stand in, then the planner's figure: the card's rated tensor
throughput at the utilisation measured on the H200, or on a CPU its step time for the model and the row
(engine.hardware.row_lengths.cpu_step_seconds). Once steps are timed, the run's own recent pace replaces it,
updated every step. When training ends, the first estimate the user saw is set beside the time it took. Pure
functions on plain values; Qt-free.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.hardware import gpus

FIRST_STEPS = 3
"""Steps timed before the run's own pace replaces an estimate (the first step carries one-off warm-up)."""


@dataclass(frozen=True)
class MeasuredRow:
    """One earlier run's throughput on this machine."""

    gpu_class: str
    gpu_name: str
    """The card's name ("" on a CPU run)."""
    model: str
    qlora: bool
    tokens_per_batch: int
    tokens_per_s: float
    """Mean tokens/s over the run's steps (their own time: pauses and evaluations are not in it)."""
    method: str = "sft"
    """The training method ("sft", "dpo"): a preference step reads two answers, so its pace is its own."""
    measured_by_tunedeck: bool = False
    """A row of TuneDeck's benchmarks (:data:`MEASURED_ROWS`), not a run on this machine."""


MEASURED_ROWS: tuple[MeasuredRow, ...] = (
    MeasuredRow(gpus.HOPPER, "NVIDIA H200", "llama-3.2-1b", False, 16_384, 16_384 / 0.210, measured_by_tunedeck=True),
    MeasuredRow(gpus.HOPPER, "NVIDIA H200", "qwen3-0.6b", False, 16_384, 16_384 / 0.169, measured_by_tunedeck=True),
    MeasuredRow(gpus.HOPPER, "NVIDIA H200", "llama-3.1-8b", True, 4_096, 12_897.0, measured_by_tunedeck=True),
)
"""TuneDeck's measured steps on the H200 (shared/DESIGN.md, 2026-12-03): bf16 LoRA on one 16,384-token row at 210 and
169 ms a step, and the 8B NF4 QLoRA row of 4,096 tokens at 12,897 tokens/s through ``tunedeck train``. Steps only:
a run's evaluations and saves come on top."""


def model_key(name: str) -> str:
    """A model's name as the built-in shapes spell it ("meta-llama/Llama-3.1-8B-Instruct" -> "llama-3.1-8b")."""
    key = re.sub(r"[^a-z0-9.]+", "-", name.rsplit("/", 1)[-1].lower()).strip("-")
    return key.removeprefix("meta-").removesuffix("-instruct")


@dataclass(frozen=True)
class TimeEstimate:
    """A training time and what it rests on."""

    seconds: float | None
    """The whole training time (None: not known yet)."""
    basis: str
    """In words: "from 2 earlier runs of this model here", "from the planner's figure for this card", "from its last
    20 steps"; for no estimate, when there will be one."""
    source: str
    """"measured" (earlier runs), "planner", "steps" (this run's own pace) or "none"."""
    left_s: float | None = None
    """While running: the time left."""


NO_ESTIMATE = TimeEstimate(None, "known after the first steps", "none")


def _nearest(rows: Sequence[MeasuredRow], tokens_per_batch: int) -> list[MeasuredRow]:
    """The rows whose row length is nearest ``tokens_per_batch`` (throughput changes with it)."""
    distance = {row: abs(math.log(max(row.tokens_per_batch, 1) / max(tokens_per_batch, 1))) for row in rows}
    best = min(distance.values())
    return [row for row in rows if distance[row] == best]


def before_start(
    *,
    steps: int | None,
    tokens_per_step: int,
    gpu_class: str,
    gpu_name: str,
    model: str,
    qlora: bool,
    rows: Iterable[MeasuredRow],
    planner_tokens_per_s: float | None,
    method: str = "sft",
) -> TimeEstimate:
    """The training time of ``steps`` steps of ``tokens_per_step`` tokens, before the run starts: the steps at the
    pace measured here or by TuneDeck, else at the planner's."""
    if not steps:
        return TimeEstimate(None, "known once the dataset's size is", "none")
    key = model_key(model)
    here = [row for row in rows if row.gpu_class == gpu_class and model_key(row.model) == key and row.method == method]
    same_model = here or [row for row in MEASURED_ROWS if row.gpu_class == gpu_class and row.model == key]
    same_card = [row for row in same_model if row.gpu_name == gpu_name] or same_model
    matching = [row for row in same_card if row.qlora == qlora] or same_card
    if matching:
        chosen = _nearest(matching, tokens_per_step)
        # a step's time at the measured speed; an automatic row length (0) takes the measured runs' own
        step_s = statistics.median((tokens_per_step or row.tokens_per_batch) / row.tokens_per_s for row in chosen)
        if not here:
            where = "on this CPU class" if gpu_class == "cpu" else "on this GPU class"
            return TimeEstimate(steps * step_s, f"from TuneDeck's measured steps {where}", "measured")
        runs = f"{len(chosen)} earlier run{'s' if len(chosen) > 1 else ''}"
        return TimeEstimate(steps * step_s, f"from {runs} of this model here", "measured")
    if planner_tokens_per_s and tokens_per_step:
        device = "this computer's CPU" if gpu_class == "cpu" else "this card"
        return TimeEstimate(steps * tokens_per_step / planner_tokens_per_s, f"from the planner's figure for {device}",
                            "planner")  # fmt: skip
    return NO_ESTIMATE


def during_run(
    before: TimeEstimate | None, step: int, total_steps: int, steps_timed: int, recent_step_s: Sequence[float]
) -> TimeEstimate | None:
    """After a step: from ``FIRST_STEPS`` timed steps on, the run's own pace (its recent steps, the first timed one
    left out while there are others) gives the time left and the whole; before that, ``before`` stands."""
    if steps_timed < FIRST_STEPS or not recent_step_s:
        return before
    first = steps_timed == len(recent_step_s)
    window = list(recent_step_s[1:] if first else recent_step_s)
    pace = statistics.fmean(window)
    left = max(total_steps - step, 0) * pace
    basis = f"from its first {steps_timed} steps" if first else f"from its last {len(window)} steps"
    return TimeEstimate(pace * step + left, basis, "steps", left_s=left)


EVAL_SHARE = 1 / 3
"""An evaluation row costs about a third of a training row (a forward pass, no backward)."""


def cpu_run_seconds(
    step_s: float, steps: int, grad_accum: int, eval_rows: int, eval_every: int, anchor_step_s: float = 0.0
) -> float:
    """A CPU run's training time before its first step: its steps at ``step_s`` a packed row (the planner's figure,
    engine.hardware.row_lengths.cpu_step_seconds), plus its evaluations (every ``eval_every`` steps and at the end),
    each ``eval_rows`` forward passes, plus the knowledge anchor's passes (engine.run.anchor): a training pass and a
    forward pass of the base model over its rows each optimizer step, ``anchor_step_s`` being one training pass."""
    evaluations = (steps // eval_every if eval_every else 0) + (1 if eval_rows else 0)
    anchor = steps * anchor_step_s * (1 + EVAL_SHARE)
    return step_s * (steps * grad_accum + evaluations * eval_rows * EVAL_SHARE) + anchor


def format_duration(seconds: float) -> str:
    """'45 s', '4 min 20 s', '1 h 05 min'."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def describe_time(estimate: TimeEstimate | None, first: TimeEstimate | None, took_s: float | None, active: bool) -> str:
    """Training time in words: the estimate before and during a run, and after it how close the first one was
    ("" for a run that ended without its time known)."""
    if took_s is None and not active and (estimate is None or estimate.left_s is not None):
        return ""
    if took_s is not None and not active:
        took = f"training took {format_duration(took_s)}"
        shown = first if first is not None and first.seconds else None
        if shown is None or shown.seconds is None:
            return took
        return f"estimated {format_duration(shown.seconds)} ({shown.basis}), {took}"
    if estimate is None or estimate.seconds is None:
        return f"training time: {(estimate or NO_ESTIMATE).basis}"
    if estimate.left_s is not None and active:
        return f"about {format_duration(estimate.left_s)} left ({estimate.basis})"
    return f"training takes about {format_duration(estimate.seconds)} ({estimate.basis})"


def gpu_class_of(hardware: dict[str, Any]) -> tuple[str, str]:
    """(GPU class, card name) of a run from its registry ``hardware`` record ("cpu", "" for a CPU run)."""
    from engine.hardware import gpus

    if not str(hardware.get("device", "")).startswith("cuda"):
        return gpus.CPU, ""
    names = hardware.get("gpus") or [""]
    name = str(names[0])
    if hardware.get("gpu_class"):
        return str(hardware["gpu_class"]), name
    spec = gpus.find_gpu(name) if name else None
    return (spec.gpu_class if spec else "unknown"), name
