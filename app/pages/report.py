"""Report page: a run's before/after report, the model before the run and tuned side by side.

The report (engine.run.report) scores the model before the run (the base model, or a DPO run's starting adapter) and
the run's adapters on the run's held-out examples (loss, perplexity, exact match and token F1 of short answers; for
DPO the share of held-out pairs preferred, where chance is 50%, and reward accuracy against the run's reference) and
on a fixed general-English text, the forgetting check. It is built when a run in this window ends, or for any run
from the Runs page's Report button, in a background job: reading or measuring it imports torch and loads the model,
never on the GUI thread. The page shows the forgetting check in words, a bar chart of every figure and the report's
Markdown text, as written to ``report.md`` in the run folder.
"""

from __future__ import annotations

import html
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import shiboken6
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QSplitter, QTextBrowser, QVBoxLayout, QWidget

from app.background.worker import ErrorInfo, TaskRunner
from app.theme import ERROR_COLOR
from app.widgets.report_chart import ReportChart

if TYPE_CHECKING:
    from engine.run.report import ReportOutcome, RunReport

EMPTY_TEXT = (
    "No report shown yet. A before/after report is made when a run ends in this window (the Run page offers "
    "“Open report”); for an earlier run, select it on the Runs page and press Report."
)
BUILDING_TEXT = "Building the before/after report…"


def read_or_build(folder: str, cancelled: Callable[[], bool]) -> ReportOutcome:
    """The run's written report, or one measured and written now (runs in a background job)."""
    from engine.run.report import REPORT_MD, ReportOutcome, read_report

    report = read_report(folder)
    if report is not None:
        return ReportOutcome(report, Path(folder) / REPORT_MD, None)
    return measure(folder, cancelled)


def measure(folder: str, cancelled: Callable[[], bool]) -> ReportOutcome:
    """Measure the run's report and write it (runs in a background job: the import alone loads torch); stops
    between batches once ``cancelled`` says so."""
    from engine.run.report import report_after_run

    return report_after_run(folder, cancelled=cancelled)


def forgetting_text(report: RunReport) -> str:
    """What each adapter kept of the base model's knowledge (the headline) and how it reads general English, with
    the warning where an adapter kept under 90% (rich text)."""
    from engine.run.report import forgetting_line, knowledge_line

    base, tuned = report.models[0], report.models[1:]
    lines = [
        f"{m.label}: {knowledge_line(report.knowledge_base_right, m)}" for m in tuned if m.knowledge_kept is not None
    ]
    lines += [f"{m.label}: {forgetting_line(base, m)}" for m in tuned]
    warning = report.knowledge_warning()
    if warning:
        lines.insert(0, f"<span style='color:{ERROR_COLOR}'><b>Warning: {warning}.</b></span>")
    return "<br>".join(html.escape(line, quote=False) if not line.startswith("<span") else line for line in lines)


class ReportPage(QWidget):
    """One run's report: the forgetting check in words, the chart of every figure, and the Markdown text."""

    building = Signal(str)
    """A run's report is being measured (its folder)."""
    ready = Signal(str)
    """A run's report is written (its folder)."""
    failed = Signal(str, str)
    """No report for a run (its folder, and why, with the command that tries again)."""

    def __init__(self, tasks: TaskRunner, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.tasks = tasks
        self.folder: str | None = None
        """The run shown (or being read for this page)."""
        self.report: RunReport | None = None
        self._jobs: set[str] = set()
        self._closing = threading.Event()
        """Set when the window closes: a report being measured stops at its next batch."""
        self.heading = QLabel("")
        self.status = QLabel(EMPTY_TEXT)
        self.status.setWordWrap(True)
        self.forgetting = QLabel("")
        self.forgetting.setTextFormat(Qt.TextFormat.RichText)
        self.forgetting.setStyleSheet("font-weight:bold")
        self.measure_button = QPushButton("Measure again")
        self.measure_button.setToolTip("Score the base model and the adapters again (loads the model)")
        self.measure_button.clicked.connect(lambda: self.build(self.folder) if self.folder else None)
        self.chart = ReportChart()
        self.text = QTextBrowser()
        self.text.setMinimumHeight(160)
        self.figures = QSplitter(Qt.Orientation.Vertical)  # the chart over the text, as the Runs page has them
        self.figures.addWidget(self.chart)
        self.figures.addWidget(self.text)
        self.figures.setStretchFactor(0, 3)
        self.figures.setStretchFactor(1, 2)
        top = QHBoxLayout()
        top.addWidget(self.heading, 1)
        top.addWidget(self.measure_button)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.status)
        layout.addWidget(self.forgetting)
        layout.addWidget(self.figures, 1)
        self._show(None)

    def open_run(self, folder: str) -> None:
        """Show ``folder``'s report: read from the run folder, or measured first where it has none."""
        self.folder = str(folder)
        self.heading.setText(f"<b>{Path(folder).name}</b>")
        self._show(None)
        measuring = not (Path(folder) / "report.json").exists()
        self.status.setText(BUILDING_TEXT if measuring else "Reading the report…")
        self._start(self.folder, lambda: read_or_build(str(folder), self._closing.is_set), announce=measuring)

    def build(self, folder: str) -> None:
        """Measure ``folder``'s report again and write it (Measure again, or a run that just ended elsewhere)."""
        folder = str(folder)
        if folder == self.folder:
            self.status.setText(BUILDING_TEXT)
        self._start(folder, lambda: measure(folder, self._closing.is_set), announce=True)

    def follow_run(self, folder: str) -> None:
        """A run just ended in this window: the page shows it, and its report as soon as it is written (not the
        empty page until Open report is pressed)."""
        self.folder = str(folder)
        self.heading.setText(f"<b>{Path(folder).name}</b>")
        self._show(None)
        self.build(self.folder)

    def busy(self) -> bool:
        return bool(self._jobs)

    def shut_down(self) -> None:
        """The window is closing: reports being measured stop at their next batch, writing nothing."""
        self._closing.set()

    def _start(self, folder: str, job: Callable[[], ReportOutcome], announce: bool) -> None:
        if folder in self._jobs:
            return  # its report is on the way
        self._jobs.add(folder)
        self.measure_button.setEnabled(False)
        if announce:
            self.building.emit(folder)
        self.tasks.start(job, lambda outcome: self._done(folder, outcome), lambda info: self._failed(folder, info))

    def _failed(self, folder: str, info: ErrorInfo) -> None:
        from engine.run.report import ReportOutcome

        self._done(folder, ReportOutcome(None, None, f"{info.message}; try: tunedeck report {folder}"))

    def _done(self, folder: str, outcome: ReportOutcome) -> None:
        self._jobs.discard(folder)
        if not shiboken6.isValid(self.measure_button):
            return  # the window closed and its widgets went before the job's end arrived
        self.measure_button.setEnabled(self.folder is not None and self.folder not in self._jobs)
        if outcome.report is None:
            self.failed.emit(folder, outcome.note or "")
        else:
            self.ready.emit(folder)
        if folder != self.folder:
            return
        if outcome.report is None:
            self.status.setText(f"<span style='color:{ERROR_COLOR}'>{outcome.note}</span>")
        else:
            self._show(outcome.report)

    def _show(self, report: RunReport | None) -> None:
        self.report = report
        self.chart.show_report(report)
        self.figures.setVisible(report is not None)
        self.measure_button.setVisible(self.folder is not None)
        if report is None:
            self.forgetting.setText("")
            self.text.setMarkdown("")
            if self.folder is None:
                self.status.setText(EMPTY_TEXT)
            return
        self.status.setText(f"Written to {Path(self.folder or '', 'report.md')}")
        self.forgetting.setText(forgetting_text(report))
        self.text.setMarkdown(report.markdown())
