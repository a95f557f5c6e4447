"""Threads that keep the window responsive: the training run, one-off background jobs, and telemetry.

The engine is an iterator of events; :class:`TrainingWorker` iterates it in a QThread and re-emits each event as
a Qt signal, so widgets only ever see plain event objects on the GUI thread. Pause, resume, stop and new speed
settings go through the run's :class:`~engine.run.control.RunControl`, which the engine reads between two steps.

On a two-core machine torch's intra-op pool would take both cores and the window would stutter; the worker
leaves one core to the GUI (``torch.set_num_threads(cpu_count - 1)``, at least 1). Only the CPU pool is capped:
on a GPU the work runs on the card and the cap costs nothing.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal

from engine.config import RunConfig, SpeedConfig
from engine.errors import TuneDeckError
from engine.run.control import RunControl


@dataclass(frozen=True)
class ErrorInfo:
    """A failure as the window shows it: what happened and what to do next."""

    message: str
    hint: str | None = None


def describe_error(err: BaseException) -> ErrorInfo:
    """A readable message and a hint for any exception, instead of a traceback."""
    if isinstance(err, TuneDeckError):
        return ErrorInfo(err.message, err.hint)
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if isinstance(err, MemoryError) or "out of memory" in text.lower():
        return ErrorInfo(
            f"out of memory: {text or type(err).__name__}",
            "lower tokens per batch or max sequence length, or turn on QLoRA or checkpointing",
        )
    if isinstance(err, ModuleNotFoundError) and err.name:
        package = err.name.split(".")[0]
        return ErrorInfo(
            f"a package TuneDeck needs is not installed: {package}",
            f"install it into TuneDeck's environment (pip install {package}), or reinstall TuneDeck",
        )
    if isinstance(err, FileNotFoundError):
        return ErrorInfo(f"file not found: {err.filename or text}", "check the path and pick the file again")
    return ErrorInfo(f"{type(err).__name__}: {text}" if text else type(err).__name__, None)


def training_threads(cpu_count: int | None = None) -> int:
    """CPU threads for torch during a run: all cores but one, which stays with the window."""
    return max(1, (cpu_count or os.cpu_count() or 1) - 1)


def lower_thread_priority(niceness: int = 10) -> None:
    """Let the window's thread win the CPU over the training thread when cores are busy (Linux: per thread)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)


def open_run_history() -> Any:
    """The user's run registry, or None when it cannot be opened: a run never depends on it."""
    from engine.run.registry import Registry, RegistryError

    try:
        return Registry()
    except (RegistryError, OSError):
        return None


class TrainingWorker(QThread):
    """Runs ``engine.train.run`` in its own thread and emits every event."""

    run_event = Signal(object)

    def __init__(self, config: RunConfig, resume: str | Path | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.config = config
        self.resume_dir = resume
        self.control = RunControl()

    def run(self) -> None:
        try:
            import torch

            torch.set_num_threads(training_threads())
            lower_thread_priority()
            from engine.quiet import quiet_libraries
            from engine.run.recorder import recorded
            from engine.train import run

            quiet_libraries()
            events = run(self.config, control=self.control, resume=self.resume_dir)
            for event in recorded(events, open_run_history()):  # so the Runs page lists it
                self.run_event.emit(event)
        except Exception as err:  # the engine reports its own failures; this catches import-time ones
            from engine.events import RunFailed

            info = describe_error(err)
            self.run_event.emit(RunFailed(info.message, info.hint, 0, None))

    def pause(self) -> None:
        self.control.pause()

    def resume(self) -> None:
        self.control.resume()

    def stop(self) -> None:
        self.control.stop()

    def request_speed(self, settings: SpeedConfig) -> None:
        self.control.request_speed(settings)


class BackgroundTask(QThread):
    """Runs one function off the GUI thread (model inspection, dataset analysis, hardware detection)."""

    done = Signal(object)
    failed = Signal(object)

    def __init__(self, job: Callable[[], Any], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.job = job

    def run(self) -> None:
        try:
            result = self.job()
        except Exception as err:
            self.failed.emit(describe_error(err))
        else:
            self.done.emit(result)


class ProgressTask(BackgroundTask):
    """A background job that reports progress: ``job(report)`` calls ``report(what, done, total)`` from its thread."""

    progress = Signal(str, float, object)

    def __init__(self, job: Callable[[Callable[[str, float, float | None], None]], Any], parent: QObject | None = None):
        super().__init__(lambda: job(self.progress.emit), parent)


class TaskRunner(QObject):
    """Starts background tasks and keeps them alive until they finish, so no QThread is destroyed running."""

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._tasks: set[BackgroundTask] = set()

    def start(
        self,
        job: Callable[..., Any],
        on_done: Callable[[Any], None],
        on_failed: Callable[[ErrorInfo], None],
        on_progress: Callable[[str, float, Any], None] | None = None,
    ) -> BackgroundTask:
        """Run ``job`` in its own thread; with ``on_progress``, ``job`` takes a ``report(what, done, total)``."""
        task: BackgroundTask
        if on_progress is not None:
            task = ProgressTask(job)
            task.progress.connect(on_progress)
        else:
            task = BackgroundTask(job)
        task.done.connect(on_done)
        task.failed.connect(on_failed)
        task.finished.connect(lambda: self._tasks.discard(task))
        self._tasks.add(task)
        task.start()
        return task

    def busy(self) -> bool:
        return any(task.isRunning() for task in self._tasks)

    def wait_all(self, timeout_ms: int = 30_000) -> None:
        for task in list(self._tasks):
            task.wait(timeout_ms)


class TelemetryBridge(QObject):
    """Hands telemetry from the sampler's own thread to the GUI thread as a signal."""

    received = Signal(object)

    def __init__(
        self,
        parent: QObject | None = None,
        *,
        interval_s: float = 0.5,
        nvml: Any = ...,
        device_indices: list[int] | None = None,
    ) -> None:
        super().__init__(parent)
        from engine.hardware.telemetry import TelemetrySampler

        self.sampler = TelemetrySampler(
            self.received.emit, interval_s=interval_s, nvml=nvml, device_indices=device_indices
        )

    def start(self) -> None:
        self.sampler.start()

    def stop(self) -> None:
        self.sampler.stop()
