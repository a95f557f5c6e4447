"""The whole flow on the demo model, driven like a user: pick model and data, start, watch, pause, resume,
flip a switch mid-run, stop. The window must stay responsive throughout: the GUI thread never works for more than
100 ms between two ticks of a 10 ms timer."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from app_demo import LOAD_TIMEOUT_MS, prepare_demo
from hang import HANG_MS
from PySide6.QtCore import QTimer

from app.background import run_controller as rc
from engine.events import RunFinished, SpeedChanged, StepMetrics

pytest_plugins = ["app_fixtures"]  # the window fixture and the dangling-QThread guard

STEP_TIMEOUT_MS = HANG_MS


class EventLog:
    def __init__(self, controller: Any) -> None:
        self.events: list[Any] = []
        controller.run_event.connect(self.events.append)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    def last_step(self) -> int:
        steps = self.of(StepMetrics)
        return steps[-1].step if steps else 0


def points(curve: Any) -> int:
    """How many points a pyqtgraph curve draws."""
    xs, _ = curve.getData()
    return 0 if xs is None else len(xs)


class GapMeter:
    """The most work the GUI thread did between two ticks of a 10 ms timer: how long it kept the event loop busy.

    Work is the thread's own CPU time (``time.thread_time``), not the wall clock: on a machine busy with other
    processes the ticks arrive late, but a slot that computes for too long on the GUI thread still shows in full.
    The wall-clock gap is kept for the message.
    """

    def __init__(self) -> None:
        self.max_work = 0.0
        self.max_gap = 0.0
        self.ticks = 0
        self._last = (time.perf_counter(), time.thread_time())
        self.timer = QTimer(interval=10)
        self.timer.timeout.connect(self._tick)

    def start(self) -> None:
        self._last = (time.perf_counter(), time.thread_time())
        self.timer.start()

    def _tick(self) -> None:
        now = (time.perf_counter(), time.thread_time())  # on the GUI thread: the timer's slot runs there
        self.max_gap = max(self.max_gap, now[0] - self._last[0])
        self.max_work = max(self.max_work, now[1] - self._last[1])
        self._last = now
        self.ticks += 1

    def stop(self) -> None:
        self.timer.stop()


def test_whole_flow_on_the_demo(qtbot: Any, window: Any, tmp_path: Path) -> None:
    prepare_demo(qtbot, window, max_steps=200)
    assert window.state.model_info.verdict == "fits"
    assert window.state.data_report.problems == []
    log = EventLog(window.controller)
    window.run_panel.start_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.RUNNING, timeout=LOAD_TIMEOUT_MS)
    meter = GapMeter()
    meter.start()
    qtbot.waitUntil(lambda: log.last_step() >= 3, timeout=STEP_TIMEOUT_MS)
    charts = window.run_panel.charts
    qtbot.waitUntil(
        lambda: points(charts.train_curve) >= 3 and points(charts.speed_curve) >= 3, timeout=STEP_TIMEOUT_MS
    )
    qtbot.waitUntil(lambda: points(charts.used_curve) >= 1, timeout=STEP_TIMEOUT_MS)  # telemetry: RAM on a CPU run

    window.run_panel.pause_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.PAUSED, timeout=STEP_TIMEOUT_MS)
    paused_at = log.last_step()
    qtbot.wait(600)  # a step taken while paused would arrive here; a slow machine can only hide one, never fake one
    assert log.last_step() == paused_at, "steps were taken while paused"
    window.run_panel.resume_button.click()
    qtbot.waitUntil(lambda: log.last_step() >= paused_at + 2, timeout=STEP_TIMEOUT_MS)

    changes_before = len(log.of(SpeedChanged))
    window.speed_panel.metadata_box.setChecked(not window.speed_panel.metadata_box.isChecked())
    qtbot.waitUntil(lambda: len(log.of(SpeedChanged)) > changes_before, timeout=STEP_TIMEOUT_MS)
    flipped = log.of(SpeedChanged)[-1]
    assert flipped.step > 0
    assert flipped.state["metadata_cache"]["on"] == window.speed_panel.metadata_box.isChecked()
    requested = window.controller.current_speed()
    assert (requested.checkpointing, requested.moe_routing) == ("auto", "auto"), "only the flipped switch changes"
    qtbot.waitUntil(lambda: log.last_step() > flipped.step + 1, timeout=STEP_TIMEOUT_MS)
    window.run_panel.charts.redraw_all()
    assert [step for step, _ in window.run_panel.charts.marks] == [flipped.step]

    window.run_panel.stop_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.FINISHED, timeout=STEP_TIMEOUT_MS)
    meter.stop()
    finished = log.of(RunFinished)[-1]
    assert finished.cancelled and finished.step < 200
    assert (Path(finished.run_dir) / "checkpoints").is_dir()
    assert Path(finished.adapter_dir, "adapter_config.json").exists()
    assert meter.ticks > 50
    assert meter.max_work < 0.100, (
        f"the GUI thread worked {meter.max_work * 1000:.0f} ms between two ticks "
        f"(the longest wall-clock gap was {meter.max_gap * 1000:.0f} ms)"
    )
    qtbot.waitUntil(lambda: not window.controller.worker.isRunning(), timeout=STEP_TIMEOUT_MS)


def test_a_stopped_run_is_in_the_history_and_resumes(qtbot: Any, window: Any) -> None:
    from engine.events import RunStarted
    from engine.run.registry import Registry

    prepare_demo(qtbot, window, max_steps=200)
    log = EventLog(window.controller)
    window.run_panel.start_button.click()
    qtbot.waitUntil(lambda: log.last_step() >= 2, timeout=LOAD_TIMEOUT_MS)
    window.run_panel.stop_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.FINISHED, timeout=STEP_TIMEOUT_MS)
    stopped = log.of(RunFinished)[-1]
    assert any(record.folder == stopped.run_dir for record in Registry().runs())

    window.run_panel.resume_run(stopped.run_dir)
    qtbot.waitUntil(lambda: len(log.of(RunStarted)) == 2, timeout=LOAD_TIMEOUT_MS)
    assert log.of(RunStarted)[-1].start_step == stopped.step
    window.run_panel.charts.redraw_all()
    steps = window.run_panel.charts.buffers["step"]
    assert steps[: stopped.step] == list(range(1, stopped.step + 1)), "the resumed run's curve starts at step 1"
    assert len(steps) == len(set(steps)), "no step drawn twice"
    qtbot.waitUntil(lambda: log.last_step() > stopped.step, timeout=STEP_TIMEOUT_MS)
    window.run_panel.stop_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.FINISHED, timeout=STEP_TIMEOUT_MS)
    assert log.of(RunFinished)[-1].run_dir == stopped.run_dir


def test_closing_the_window_during_a_run_stops_it_cleanly(qtbot: Any, window: Any) -> None:
    prepare_demo(qtbot, window, max_steps=200)
    log = EventLog(window.controller)
    window.run_panel.start_button.click()
    qtbot.waitUntil(lambda: log.last_step() >= 1, timeout=LOAD_TIMEOUT_MS)
    window.close()  # stops the run (a checkpoint is saved) and joins its thread before the window goes
    assert not window.controller.worker.isRunning()
    qtbot.waitUntil(lambda: bool(log.of(RunFinished)), timeout=STEP_TIMEOUT_MS)  # queued events still arrive
    assert log.of(RunFinished)[-1].cancelled
