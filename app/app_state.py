"""What the user has chosen so far (model, dataset, settings) and what the machine is, shared by the pages, and the
run going on (or the last one) as every page shows it.

Pages write their choice here and listen for the others' changes; none of them talks to another page directly.
The run's state, peak memory, speed and time are one :class:`engine.run.summary.RunSummary`, folded here from the
run controller's events before any page sees them; pages read it on ``run_changed`` and word it with
``engine.run.summary.describe``, so no two pages can disagree.
"""

from __future__ import annotations

import time
from typing import Any

from PySide6.QtCore import QObject, Signal

from engine.config import DEMO_MODEL
from engine.events import RunStarted
from engine.hardware.recipes import RecipeEstimate
from engine.run.estimate import MeasuredRow, TimeEstimate
from engine.run.summary import RunSummary, seeded, summarize, with_state


class AppState(QObject):
    """The choices behind the next run."""

    hardware_changed = Signal()
    model_changed = Signal()
    data_changed = Signal()
    run_changed = Signal()
    plan_changed = Signal()

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.hardware: Any = None
        """engine.hardware.detect.HardwareInfo once detection has run in the background."""
        self.profile: Any = None
        """engine.hardware.profile.Profile for the machine (and the model, once one is inspected)."""
        self.model_name: str = DEMO_MODEL
        self.model_info: Any = None
        """engine.model.info.ModelInfo of the chosen model, or None while it is being inspected."""
        self.data_path: str = ""
        self.data_report: Any = None
        """engine.run.data_report.DatasetReport of the chosen dataset."""
        self.run = RunSummary()
        """The run going on, or the last one this session (idle before the first)."""
        self.planned_peak: int | None = None
        """The plan's predicted peak for the current settings (None: not known)."""
        self.planned_time: TimeEstimate | None = None
        """How long the current settings train here, before Start."""
        self.planned_figure: RecipeEstimate | None = None
        """The planner's estimate behind those two, worded on every page by engine.hardware.recipes.describe_peak."""
        self.planned_recipe: str = ""
        """The recipe the current settings started from (the Recipe page's choice)."""
        self.measured: list[MeasuredRow] = []
        """Earlier runs' throughput on this machine, for time estimates (engine.run.summary.measured_rows)."""

    def set_hardware(self, hardware: Any, profile: Any) -> None:
        self.hardware, self.profile = hardware, profile
        self.hardware_changed.emit()

    def set_model(self, name: str, info: Any) -> None:
        self.model_name, self.model_info = name, info
        self.model_changed.emit()

    def set_data(self, path: str, report: Any) -> None:
        self.data_path, self.data_report = path, report
        self.data_changed.emit()

    def set_plan(
        self, peak: int | None, estimate: TimeEstimate | None, figure: RecipeEstimate | None = None, recipe: str = ""
    ) -> None:
        """The plan for the current settings: predicted peak memory and training time, the planner's estimate they
        come from and the recipe they started from."""
        plan = (peak, estimate, figure, recipe)
        if plan != (self.planned_peak, self.planned_time, self.planned_figure, self.planned_recipe):
            self.planned_peak, self.planned_time, self.planned_figure, self.planned_recipe = plan
            self.plan_changed.emit()

    def begin_run(self) -> None:
        """A run is starting with the current plan: its summary starts from the plan's figures."""
        estimate = self.planned_time
        first = estimate if estimate is not None and estimate.seconds else None
        self.run = RunSummary(state="loading", predicted_peak_bytes=self.planned_peak, estimate=estimate,
                              first_estimate=first)  # fmt: skip
        self.run_changed.emit()

    def follow_event(self, event: object) -> None:
        """A run event (connected to the run controller before any page is)."""
        summary = summarize(self.run, event, now=time.monotonic())
        if isinstance(event, RunStarted) and event.start_step > 0:  # resumed: its earlier steps count too
            summary = seeded(summary, event.run_dir, event.start_step)
        if summary != self.run:
            self.run = summary
            self.run_changed.emit()

    def follow_state(self, state: str) -> None:
        """The controller's own states that no event reports (stopping; a thread that ended without an event)."""
        if state in ("stopping", "failed") and self.run.state != state and self.run.active:
            self.run = with_state(self.run, state)
            self.run_changed.emit()
