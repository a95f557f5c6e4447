"""One run at a time: the training worker, the telemetry sampler, and the run's state for every panel.

Panels never hold the worker: they call :class:`RunController` and listen to its signals, so the run page and
the speed page see the same events in the same order.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal

from app.background.worker import TelemetryBridge, TrainingWorker
from engine.config import RunConfig, SpeedConfig
from engine.events import RunFailed, RunFinished, RunPaused, RunResumed, RunStarted, SpeedChanged
from engine.run.background import release_freed_memory

IDLE, LOADING, RUNNING, PAUSED, STOPPING, FINISHED, FAILED = (
    "idle", "loading", "running", "paused", "stopping", "finished", "failed",
)  # fmt: skip


class RunController(QObject):
    """Starts, steers and ends the training run; re-emits its events and the GPU telemetry."""

    run_event = Signal(object)
    telemetry = Signal(object)
    state_changed = Signal(str)
    run_over = Signal(str)
    """A run's thread has ended after it finished (not stopped by the user) with an adapter: its folder. The run's
    before/after report is measured then, once the run's model has gone."""

    def __init__(self, parent: QObject | None = None, *, telemetry_nvml: Any = ...) -> None:
        super().__init__(parent)
        self.worker: TrainingWorker | None = None
        self.state = IDLE
        self.config: RunConfig | None = None
        self.speed_state: dict[str, dict[str, Any]] = {}
        self.last_step = 0
        self._telemetry_nvml = telemetry_nvml
        self._telemetry: TelemetryBridge | None = None
        self.ended: RunFinished | None = None
        """How the last run ended (None while it goes, or when it failed)."""

    @property
    def active(self) -> bool:
        return self.state in (LOADING, RUNNING, PAUSED, STOPPING)

    def start(self, config: RunConfig, resume: str | Path | None = None, gpu_indices: list[int] | None = None) -> None:
        """Start a run; ``gpu_indices`` are the cards it trains on (their telemetry lanes are charted)."""
        if self.active:
            raise RuntimeError("a run is already going")
        self.config = config
        self.speed_state, self.last_step, self.ended = {}, 0, None
        self._retire_worker()
        self.worker = TrainingWorker(config, resume)
        self.worker.run_event.connect(self._on_event)
        self.worker.finished.connect(self._on_worker_finished)
        self._set_state(LOADING)
        self.worker.start()
        self._telemetry = TelemetryBridge(interval_s=0.5, nvml=self._telemetry_nvml, device_indices=gpu_indices)
        self._telemetry.received.connect(self.telemetry)
        self._telemetry.start()

    def _retire_worker(self) -> None:
        """Let the previous run's thread return before its QThread object is dropped.

        The run reports its end as an event a moment before the thread itself exits; destroying a QThread that
        is still running aborts the whole process.
        """
        previous = self.worker
        if previous is not None and not previous.wait(30_000):
            raise RuntimeError("the previous run's thread did not finish")

    def pause(self) -> None:
        if self.worker is not None and self.state == RUNNING:
            self.worker.pause()

    def resume(self) -> None:
        if self.worker is not None and self.state == PAUSED:
            self.worker.resume()

    def stop(self) -> None:
        if self.worker is not None and self.active:
            self.worker.stop()
            self._set_state(STOPPING)

    def request_speed(self, settings: SpeedConfig) -> None:
        """New speed settings, applied by the engine before the next step."""
        if self.config is not None:
            self.config = dataclasses.replace(self.config, speed=settings)
        if self.worker is not None and self.active:
            self.worker.request_speed(settings)

    def current_speed(self) -> SpeedConfig:
        return dataclasses.replace(self.config.speed) if self.config else SpeedConfig()

    def shutdown(self, timeout_ms: int = 60_000) -> None:
        """Stop the run (it saves a checkpoint) and wait for its thread; used when the window closes."""
        if self.worker is not None:
            self.worker.stop()
            self.worker.wait(timeout_ms)
        self._stop_telemetry()

    def _on_event(self, event: object) -> None:
        if isinstance(event, RunStarted):
            self._set_state(RUNNING)
        elif isinstance(event, RunPaused):
            self._set_state(PAUSED)
        elif isinstance(event, RunResumed):
            self._set_state(RUNNING)
        elif isinstance(event, SpeedChanged):
            self.speed_state = event.state
        elif isinstance(event, RunFinished):
            self.ended = event
            self._set_state(FINISHED)
        elif isinstance(event, RunFailed):
            self._set_state(FAILED)
        step = getattr(event, "step", None)
        if isinstance(step, int):
            self.last_step = max(self.last_step, step)
        self.run_event.emit(event)

    def _on_worker_finished(self) -> None:
        self._stop_telemetry()
        # off the GUI thread: a full collection and a trim of a large heap each took over 100 ms of it (the window's
        # run test holds the GUI thread to 100 ms of work between two ticks); Python's collector stays on
        # app.background.gui_gc
        threading.Thread(target=release_freed_memory, name="release-freed-memory", daemon=True).start()
        if self.active:  # the thread ended without a final event
            self._set_state(FAILED)
        ended = self.ended
        if ended is not None and not ended.cancelled and Path(ended.adapter_dir, "adapter_config.json").exists():
            self.run_over.emit(ended.run_dir)  # a stopped run gets its report from the Runs page, on request

    def _stop_telemetry(self) -> None:
        if self._telemetry is not None:
            self._telemetry.stop()
            self._telemetry = None

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.state_changed.emit(state)
