"""What every page says about a run (its state, peak memory and speed), from one fold and one formatting function.

Pages used to keep figures of their own: the Run page the largest step peak, the Runs page the last step's tokens/s
from the registry, the Recipe page the planner's predicted peak; on the demo they read 5.1 GiB on one page and
0.1 GiB on another, both called "peak memory". Here a :class:`RunSummary` is folded from the run's events
(:func:`summarize`) or, for a past run, from the same step records in its folder's ``metrics.jsonl``
(:func:`summary_of_folder`), and :func:`describe` turns it into the words every page shows, each figure labelled:
memory *measured* during the run (the GPU memory the run reserved, or the process's resident memory on a CPU run)
apart from the memory the plan *predicted* (the training's tensors alone). Speed is the run's mean: tokens trained
over the time its steps took. Qt-free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import events as ev
from engine.run.estimate import MeasuredRow, TimeEstimate, describe_time, during_run, gpu_class_of

GIB = 1 << 30
STOPPED_MESSAGE = "stopped by the user"
"""The registry message of a run the user stopped (its status is "interrupted": it can be resumed)."""
ACTIVE_STATES = frozenset({"loading", "running", "paused", "stopping"})
STEP_FIELDS = frozenset(field.name for field in dataclasses.fields(ev.StepMetrics))


@dataclass(frozen=True)
class RunSummary:
    """A run as the pages show it. Figures are None until the run has measured them."""

    state: str = "idle"
    """idle, loading, running, paused, stopping, finished, stopped, failed or interrupted."""
    run_dir: str = ""
    device: str = ""
    """The torch device ("cpu", "cuda:0"): what the measured peak counts."""
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    steps_timed: int = 0
    tokens: int = 0
    """Tokens of the timed steps (this session's steps; a resumed run's earlier steps from its folder)."""
    step_seconds: float = 0.0
    """The time those steps took (pauses, loading and checkpoints not included)."""
    recent_step_seconds: tuple[float, ...] = ()
    """The last steps' times, for the remaining time (speed switches change the pace)."""
    peak_memory_bytes: int | None = None
    """The largest step peak measured (StepMetrics.memory_bytes)."""
    driver_peak_bytes: int | None = None
    """The largest of the driver's figures for the process (CUDA context included), where it gave one."""
    predicted_peak_bytes: int | None = None
    """The plan's predicted peak for this run's settings (None where the plan has no figure)."""
    estimate: TimeEstimate | None = None
    """How long training takes: before Start from measured runs or the planner, then from the run's own steps."""
    first_estimate: TimeEstimate | None = None
    """The estimate the user saw first (before Start, or after the first steps): compared with the time taken."""
    training_seconds: float | None = None
    """Training's wall time once it ended (RunFinished.wall_time_s less the time it spent paused)."""
    paused_at: float | None = None
    paused_seconds: float = 0.0
    resumable: bool = False
    message: str = ""

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.step_seconds if self.step_seconds > 0 else None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


@dataclass(frozen=True)
class RunTexts:
    """The words for a run, the same on every page."""

    state: str
    progress: str
    peak: str
    """The measured peak and what it counts, "5.12 GiB (process memory)" ("" before the first step)."""
    planned: str
    """The plan's predicted peak, "0.10 GiB" ("" when unknown)."""
    speed: str
    """The run's mean speed, "1,234 tokens/s"."""
    time: str

    def line(self) -> str:
        """Everything in one line, each figure labelled."""
        parts = (
            self.state.capitalize(), self.progress,
            f"peak memory measured: {self.peak}" if self.peak else "",
            f"predicted by the plan: {self.planned}" if self.planned else "",
            f"speed: {self.speed} (mean)" if self.speed else "", self.time,
        )  # fmt: skip
        return " · ".join(part for part in parts if part)


RECENT_STEPS = 20


def summarize(summary: RunSummary, event: object, now: float | None = None) -> RunSummary:
    """The summary after ``event`` (a run event; anything else leaves it as it was); ``now``: a monotonic clock's
    reading when it arrived, to leave pauses out of the training time."""
    if isinstance(event, ev.RunStarted):
        return dataclasses.replace(summary, state="running", run_dir=event.run_dir, device=event.device,
                                   step=event.start_step, total_steps=event.total_steps, message="")  # fmt: skip
    if isinstance(event, ev.StepMetrics):
        return _with_step(summary, event)
    if isinstance(event, ev.RunPaused):
        return dataclasses.replace(summary, state="paused", paused_at=now)
    if isinstance(event, ev.RunResumed):
        return dataclasses.replace(summary, state="running", paused_at=None, paused_seconds=_paused(summary, now))
    if isinstance(event, ev.RunFinished):
        loss = event.final_loss if event.final_loss is not None else summary.loss
        resumable = event.cancelled and (Path(event.run_dir) / "checkpoints").is_dir()
        took = max(0.0, event.wall_time_s - _paused(summary, now))
        return dataclasses.replace(summary, state="stopped" if event.cancelled else "finished", step=event.step,
                                   run_dir=event.run_dir, loss=loss, training_seconds=took, paused_at=None,
                                   resumable=resumable)  # fmt: skip
    if isinstance(event, ev.RunFailed):
        return dataclasses.replace(summary, state="failed", message=event.message, run_dir=event.run_dir or "")
    return summary


def _paused(summary: RunSummary, now: float | None) -> float:
    """The time paused so far, the pause going on now included."""
    ongoing = now - summary.paused_at if now is not None and summary.paused_at is not None else 0.0
    return summary.paused_seconds + max(0.0, ongoing)


def with_state(summary: RunSummary, state: str) -> RunSummary:
    """The window's own states that no event reports (loading, stopping)."""
    return dataclasses.replace(summary, state=state)


def _with_step(summary: RunSummary, event: ev.StepMetrics) -> RunSummary:
    peak = max(summary.peak_memory_bytes or 0, event.memory_bytes)
    driver = summary.driver_peak_bytes
    if event.driver_memory_bytes is not None:
        driver = max(driver or 0, event.driver_memory_bytes)
    recent = (*summary.recent_step_seconds, event.step_time_s)[-RECENT_STEPS:]
    updated = dataclasses.replace(
        summary, step=event.step, total_steps=event.total_steps, loss=event.loss, steps_timed=summary.steps_timed + 1,
        tokens=summary.tokens + event.tokens, step_seconds=summary.step_seconds + event.step_time_s,
        recent_step_seconds=recent, peak_memory_bytes=peak, driver_peak_bytes=driver,
    )  # fmt: skip
    estimate = during_run(summary.estimate, event.step, event.total_steps, updated.steps_timed, recent)
    first = summary.first_estimate or (estimate if estimate is not None and estimate.seconds else None)
    return dataclasses.replace(updated, estimate=estimate, first_estimate=first)


def step_events(records: Iterable[Mapping[str, Any]]) -> list[ev.StepMetrics]:
    """StepMetrics from ``metrics.jsonl`` records (torn or foreign lines skipped)."""
    steps = []
    for record in records:
        with contextlib.suppress(TypeError, ValueError):
            steps.append(ev.StepMetrics(**{key: value for key, value in record.items() if key in STEP_FIELDS}))
    return steps


def read_step_records(run_dir: str | Path, up_to_step: int | None = None) -> list[ev.StepMetrics]:
    """The steps logged in a run folder's ``metrics.jsonl`` (up to ``up_to_step``), as StepMetrics."""
    records = []
    with contextlib.suppress(OSError):
        for line in (Path(run_dir) / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and (up_to_step is None or int(record.get("step", 0)) <= up_to_step):
                    records.append(record)
    return step_events(records)


def summary_of_folder(run_dir: str | Path, state: str, device: str = "", **known: Any) -> RunSummary:
    """A past (or another process's) run: its logged steps folded as the live run's events were."""
    summary = RunSummary(state=state, run_dir=str(run_dir), device=device)
    for step in read_step_records(run_dir):
        summary = _with_step(summary, step)
    return dataclasses.replace(summary, **known)


def summary_of_record(record: Any) -> RunSummary:
    """A registry record's (RunRecord) run: its folder's step log with the record's status."""
    state = state_of_record(record.status, record.message)
    device = str((record.hardware or {}).get("device", ""))
    return summary_of_folder(record.folder, state, device, resumable=bool(record.resumable))


def seeded(summary: RunSummary, run_dir: str, up_to_step: int) -> RunSummary:
    """A resumed run's summary with the steps it logged before it stopped, as its folder's summary has them."""
    for step in read_step_records(run_dir, up_to_step):
        summary = _with_step(summary, step)
    return summary


def state_of_record(status: str, message: str | None) -> str:
    """The registry's status in the words of a live run: a run the user stopped reads "stopped"."""
    return "stopped" if status == "interrupted" and message == STOPPED_MESSAGE else status


def measured_rows(records: Iterable[Any]) -> list[MeasuredRow]:
    """Throughput rows of the finished runs in the registry's ``records`` (RunRecord), for time estimates: each
    run's configured tokens per step over its mean step time (the steps' own time: a pause, the model's loading or
    a later rename moves the record's clock, never a step's)."""
    rows = []
    for record in records:
        if record.status != "finished":
            continue
        summary = summary_of_folder(record.folder, record.status)
        if not summary.steps_timed or summary.step_seconds <= 0:
            continue
        config = record.config or {}
        data, training, model = config.get("data", {}), config.get("training", {}), config.get("model", {})
        tokens_per_step = int(data.get("tokens_per_batch") or 0) * int(training.get("grad_accum") or 1)
        if tokens_per_step <= 0:
            continue
        gpu_class, gpu_name = gpu_class_of(record.hardware or {})
        rate = tokens_per_step * summary.steps_timed / summary.step_seconds
        method = str(training.get("method") or "sft")
        rows.append(MeasuredRow(gpu_class, gpu_name, str(model.get("name", record.model)), bool(model.get("qlora")),
                                tokens_per_step, rate, method))  # fmt: skip
    return rows


def format_gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"


def measured_kind(device: str) -> str:
    """What a run's measured peak counts on ``device``."""
    return "GPU memory reserved" if device.startswith("cuda") else "process memory"


def describe(summary: RunSummary) -> RunTexts:
    """The one formatting of a run's state, peak memory, speed and time."""
    state = summary.state + (" (resumable)" if summary.resumable else "")
    progress = f"step {summary.step:,} of {summary.total_steps:,}" if summary.total_steps else ""
    peak = ""
    if summary.peak_memory_bytes:
        driver = f"; {format_gib(summary.driver_peak_bytes)} as the driver sees it" if summary.driver_peak_bytes else ""
        peak = f"{format_gib(summary.peak_memory_bytes)} ({measured_kind(summary.device)}{driver})"
    planned = format_gib(summary.predicted_peak_bytes) if summary.predicted_peak_bytes else ""
    rate = summary.tokens_per_s
    speed = f"{rate:,.0f} tokens/s" if rate else ""
    time = describe_time(summary.estimate, summary.first_estimate, summary.training_seconds, summary.active)
    return RunTexts(state, progress, peak, planned, speed, time)
