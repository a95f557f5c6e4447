"""Threads that keep the window responsive: the training run, one-off background jobs, and telemetry.

The engine is an iterator of events; :class:`TrainingWorker` iterates it in a QThread and re-emits each event as
a Qt signal, so widgets only ever see plain event objects on the GUI thread. Pause, resume, stop and new speed
settings go through the run's :class:`~engine.run.control.RunControl`, which the engine reads between two steps.

The run itself is :func:`engine.train.run_beside_window`, Qt-free, so a benchmark can take the window's path
without a window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal

from engine.config import RunConfig, SpeedConfig
from engine.errors import TuneDeckError
from engine.run.background import training_threads
from engine.run.control import RunControl

__all__ = ["BackgroundTask", "ErrorInfo", "TaskRunner", "TrainingWorker", "describe_error", "training_threads"]


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
            from engine.train import run_beside_window

            for event in run_beside_window(self.config, self.control, self.resume_dir):
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
