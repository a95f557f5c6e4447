"""Keeping a run's registry record up to date by watching its events: ``recorded(events, registry)``.

The training loop knows nothing of the registry (engine.run.registry): whoever drives a run (the app's worker,
``tunedeck train``) wraps its events in :func:`recorded`, which writes the record as the run starts, steps,
pauses and ends, and marks it interrupted when the consumer stops reading early.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

from engine.errors import TuneDeckError
from engine.run.registry import ACTIVE, Registry, process_started


def hardware_summary(device: str, dtype: str) -> dict[str, Any]:
    """What the run ran on: the torch device and dtype, and the GPUs detection saw (never fails a run)."""
    summary: dict[str, Any] = {"device": device, "dtype": dtype}
    try:
        from engine.hardware.detect import detect_hardware

        info = detect_hardware()
        summary.update(
            gpus=[gpu.name for gpu in info.gpus],
            gpu_class=info.gpu_class,  # what a later run's time estimate matches earlier runs by
            driver=info.driver_version,
            torch=info.torch_version,
            platform=info.platform,
        )
    except Exception as err:  # detection is informative only
        summary["detection_error"] = str(err)
    return summary


class RunRecorder:
    """Turns one run's events into registry writes. Step metrics are written at most every ``interval_s``."""

    def __init__(self, registry: Registry, *, name: str | None = None, interval_s: float = 1.0) -> None:
        self.registry = registry
        self.name = name
        self.interval_s = interval_s
        self.run_id: str | None = None
        self._last_write = 0.0
        self._pending: dict[str, Any] = {}
        self._steps: Any = None
        """The run's summary over its steps (engine.run.summary): the speed written is its mean, as pages show it."""

    def _writer(self) -> dict[str, Any]:
        pid = os.getpid()
        return {"pid": pid, "pid_started": process_started(pid), "host": socket.gethostname(), "heartbeat": time.time()}

    def started(self, event: Any) -> None:
        folder = Path(event.run_dir)
        config = _read_json(folder / "config.json")
        values: dict[str, Any] = {
            "status": "running",
            "config": config,
            "model": config.get("model", {}).get("name", ""),
            "dataset": config.get("data", {}).get("path", ""),
            "total_steps": event.total_steps,
            "steps": event.start_step,
            "hardware": hardware_summary(event.device, event.dtype),
            "message": None,
            **self._writer(),
        }
        if self.name:
            values["name"] = self.name
        self.run_id = self.registry.upsert(folder, **values)

    def write(self, force: bool = False, **values: Any) -> None:
        """Queue ``values``; write them now if forced or if the last write is older than the interval."""
        self._pending.update(values)
        now = time.monotonic()
        if self.run_id is None or not (force or now - self._last_write >= self.interval_s):
            return
        self.registry.update(self.run_id, heartbeat=time.time(), **self._pending)
        self._pending = {}
        self._last_write = now

    def handle(self, event: Any) -> None:
        from engine import events as ev

        if isinstance(event, ev.RunStarted):
            self.started(event)
            if event.start_step > 0:  # resumed: the mean speed counts the steps it logged before, as its folder does
                from engine.run.summary import RunSummary, seeded

                self._steps = seeded(RunSummary(), event.run_dir, event.start_step)
        elif isinstance(event, ev.StepMetrics):
            from engine.run.summary import RunSummary, summarize

            self._steps = summarize(self._steps or RunSummary(), event)
            self.write(steps=event.step, final_loss=event.loss, tokens_per_s=self._steps.tokens_per_s)
        elif isinstance(event, ev.EvalMetrics):
            self.write(eval_loss=event.loss)
        elif isinstance(event, ev.SpeedChanged):
            self.write(force=True, speed=event.state)
        elif isinstance(event, ev.RunPaused):
            self.write(force=True, status="paused")
        elif isinstance(event, ev.RunResumed):
            self.write(force=True, status="running")
        elif isinstance(event, ev.RunFinished):
            self._finished(event)
        elif isinstance(event, ev.RunFailed):
            self._failed(event)

    def _finished(self, event: Any) -> None:
        from engine.run.summary import STOPPED_MESSAGE

        status = "interrupted" if event.cancelled else "finished"
        summary = {"steps": event.step, "final_loss": event.final_loss, "eval_loss": event.eval_loss}
        values = {k: v for k, v in summary.items() if v is not None}
        self.write(force=True, status=status, message=STOPPED_MESSAGE if event.cancelled else None, **values)

    def _failed(self, event: Any) -> None:
        if self.run_id is None and event.run_dir and (Path(event.run_dir) / "config.json").exists():
            config = _read_json(Path(event.run_dir) / "config.json")
            self.run_id = self.registry.upsert(
                event.run_dir,
                status="failed",
                config=config,
                model=config.get("model", {}).get("name", ""),
                dataset=config.get("data", {}).get("path", ""),
                **({"name": self.name} if self.name else {}),
            )
        self.write(force=True, status="failed", message=event.message)

    def abandoned(self) -> None:
        """The consumer stopped reading before the run ended: the run can be resumed from its checkpoint."""
        if self.run_id is not None and self.registry.get(self.run_id).stored_status in ACTIVE:
            self.write(force=True, status="interrupted")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return data
    except (OSError, ValueError):
        return {}


def recorded(events: Iterator[Any], registry: Registry | None, *, name: str | None = None) -> Iterator[Any]:
    """Yield ``events`` unchanged while keeping the run's registry record up to date.

    A registry problem (disk full, read-only data folder) never stops a run: it is reported once as a Notice and
    recording stops.
    """
    from engine.events import Notice

    recorder = RunRecorder(registry, name=name) if registry is not None else None
    finished = False
    try:
        for event in events:
            if recorder is not None:
                try:
                    recorder.handle(event)
                except (sqlite3.Error, OSError, TuneDeckError) as err:
                    recorder = None
                    yield Notice(f"the run history could not be updated ({err}); the run goes on")
            finished = finished or type(event).__name__ in ("RunFinished", "RunFailed")
            yield event
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()  # the run's own clean-up (its generator's finally blocks) happens before the record is closed
        if recorder is not None and not finished:
            with suppress(sqlite3.Error, OSError, TuneDeckError):
                recorder.abandoned()
