"""The runs page: past runs in a table, their loss curves overlaid, and resume, report, export, rename and delete.

Rows come from the run registry; curves from each run folder's ``metrics.jsonl`` and ``eval.jsonl``, so a run
still training shows its newest steps on the next refresh (every few seconds). Selecting several runs draws them
on one chart in distinct colours (train as lines, eval as dashed lines with dots): the way to see which settings
worked. Resuming emits ``resume_requested(folder)`` for the main window, Report ``report_requested(folder)`` (the
Report page shows the run's before/after report); Export opens the export dialog for the selected run. Rename
refuses a name that is not one plain folder name; Delete removes only what TuneDeck wrote in the run's folder
(engine.run.ownership) and says what it left. A run's
state, mean speed and measured peak memory are its summary (engine.run.summary) read from its folder's step log,
worded as every page words them; the run going on in this window shows its live summary.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pyqtgraph as pg
from PySide6.QtCore import QItemSelection, QItemSelectionModel, Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QMessageBox,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.pages.export import ExportDialog
from app.theme import current_chart_colors, style_plot
from app.widgets.page_chart import PageChart
from app.widgets.rename_dialog import RenameDialog
from app.widgets.tables import read_only_table
from engine.errors import TuneDeckError
from engine.run.registry import Registry, RunRecord
from engine.run.summary import RunSummary, describe, summary_of_record

COLUMNS = ("Name", "Model", "Dataset", "Date", "Steps", "Final loss", "Speed (mean)", "Peak memory (measured)",
           "Status")  # fmt: skip
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
REFRESH_MS = 5000


@dataclass
class LossCurves:
    """A run's train loss per step and eval loss per evaluation, as read from its folder."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)


def _read_jsonl(path: Path, key: str) -> tuple[list[int], list[float]]:
    steps: list[int] = []
    values: list[float] = []
    if not path.exists():
        return steps, values
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            step, value = int(record["step"]), float(record[key])
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line of a crashed run
        steps.append(step)
        values.append(value)
    return steps, values


def read_curves(folder: str | Path) -> LossCurves:
    folder = Path(folder)
    steps, losses = _read_jsonl(folder / "metrics.jsonl", "loss")
    eval_steps, eval_losses = _read_jsonl(folder / "eval.jsonl", "eval_loss")
    return LossCurves(steps, losses, eval_steps, eval_losses)


def _cells(record: RunRecord, summary: RunSummary) -> tuple[str, ...]:
    texts = describe(summary)
    loss = "-" if record.final_loss is None else f"{record.final_loss:.4f}"
    date = dt.datetime.fromtimestamp(record.created).strftime("%Y-%m-%d %H:%M")
    model = Path(record.model).name or record.model
    step, total = max(summary.step, record.steps), summary.total_steps or record.total_steps
    steps = f"{step}/{total}" if total else str(step)
    return (record.name, model, Path(record.dataset).name, date, steps, loss, texts.speed or "-", texts.peak or "-",
            texts.state)  # fmt: skip


def _same_folder(first: str, second: str) -> bool:
    return bool(first and second) and Path(first).resolve() == Path(second).resolve()


def has_adapter(record: RunRecord) -> bool:
    """Whether the run wrote an adapter (when it finished or was stopped): only then is there anything to export."""
    return (Path(record.folder) / "adapter" / "adapter_config.json").exists()


class RunsView(QWidget):
    """Table of runs above an overlay chart of the selected runs' loss curves, with the run actions."""

    resume_requested = Signal(str)
    report_requested = Signal(str)
    """Report: the before/after report of the selected run (its folder), measured first where it has none."""
    history_changed = Signal(list)
    """The run list (RunRecords, newest first) after a run was added, renamed, deleted or changed state: the other
    pages follow it, so none shows a deleted run or an old name."""

    def __init__(self, registry: Registry | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.registry = registry if registry is not None else Registry()
        self.records: list[RunRecord] = []
        self.live = RunSummary()
        """The run going on in this window (the main window passes it on)."""
        self._summaries: dict[str, tuple[tuple[object, ...], RunSummary]] = {}
        self._history: tuple[tuple[str, str, str, str], ...] | None = None
        self.export_dialog: ExportDialog | None = None
        self.rename_dialog: RenameDialog | None = None
        self.table = self._build_table()
        self.chart = self._build_chart()
        self.message = QLabel("")
        self.message.setWordWrap(True)
        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(self.table)
        splitter.addWidget(self.chart)
        layout = QVBoxLayout(self)
        layout.addLayout(self._build_buttons())
        layout.addWidget(splitter, 1)
        layout.addWidget(self.message)
        self.timer = QTimer(self, interval=REFRESH_MS)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()
        self.refresh()

    def _build_table(self) -> QTableWidget:
        table = read_only_table(COLUMNS, several=True)
        table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        table.horizontalHeader().setStretchLastSection(True)
        table.itemSelectionChanged.connect(self._selection_changed)
        return table

    def _build_chart(self) -> pg.PlotWidget:
        chart = PageChart(title="Loss of the selected runs")
        chart.setLabel("bottom", "step")
        chart.setLabel("left", "loss")
        chart.showGrid(x=True, y=True, alpha=0.2)
        chart.addLegend(offset=(-10, 10))
        style_plot(chart, current_chart_colors())
        return chart

    def _build_buttons(self) -> QHBoxLayout:
        self.resume_button = QPushButton("Resume")
        self.export_button = QPushButton("Export…")
        self.export_button.setToolTip("The adapter, a merged model or a GGUF file, in a folder of your choice")
        self.report_button = QPushButton("Report")
        self.report_button.setToolTip(
            "Base model and tuned side by side on the run's held-out examples, and what it forgot (measured first "
            "where the run has no report)"
        )
        self.rename_button = QPushButton("Rename…")
        self.delete_button = QPushButton("Delete…")
        refresh = QPushButton("Refresh")
        self.resume_button.clicked.connect(self.resume_selected)
        self.export_button.clicked.connect(self.export_selected)
        self.report_button.clicked.connect(self.report_selected)
        self.rename_button.clicked.connect(lambda: self.rename_selected())
        self.delete_button.clicked.connect(lambda: self.delete_selected())
        refresh.clicked.connect(self.refresh)
        row = QHBoxLayout()
        for button in (self.resume_button, self.export_button, self.report_button, self.rename_button,
                       self.delete_button):  # fmt: skip
            row.addWidget(button)
        row.addStretch(1)
        row.addWidget(refresh)
        return row

    # ----------------------------------------------------------------------------------------------- state

    def refresh(self) -> None:
        """Reload the runs, keeping the selection (by run id) and redrawing the chart."""
        chosen = {record.id for record in self.selected_records()}
        try:
            self.records = self.registry.runs()
        except TuneDeckError as err:
            self.message.setText(f"cannot read the run history: {err}")
            return
        self.table.blockSignals(True)
        self.table.setRowCount(len(self.records))
        for row, record in enumerate(self.records):
            self._fill_row(row, record)
        self._select_ids(chosen)  # rows move when a run is added or deleted: select by id, never by row
        self.table.blockSignals(False)
        self._selection_changed()
        history = tuple((record.id, record.name, record.folder, record.status) for record in self.records)
        if history != self._history:
            self._history = history
            self.history_changed.emit(list(self.records))

    def summary(self, record: RunRecord) -> RunSummary:
        """The run's summary: the live one while this window runs it, else from its folder (read again only when
        its step log or status changed)."""
        if self.live.active and _same_folder(self.live.run_dir, record.folder):
            return self.live
        log = Path(record.folder) / "metrics.jsonl"
        try:
            stat = log.stat()
            key: tuple[object, ...] = (record.status, record.message, stat.st_mtime_ns, stat.st_size)
        except OSError:
            key = (record.status, record.message)
        cached = self._summaries.get(record.folder)
        if cached is None or cached[0] != key:
            cached = (key, summary_of_record(record))
            self._summaries[record.folder] = cached
        return cached[1]

    def show_live(self, summary: RunSummary) -> None:
        """The window's run changed: its row shows the live summary (at once, not at the next refresh)."""
        self.live = summary
        for row, record in enumerate(self.records):
            if _same_folder(summary.run_dir, record.folder):
                self._fill_row(row, record)

    def _fill_row(self, row: int, record: RunRecord) -> None:
        for column, text in enumerate(_cells(record, self.summary(record))):
            item = self.table.item(row, column)
            if item is None:
                item = QTableWidgetItem(text)
                self.table.setItem(row, column, item)
            item.setText(text)
            item.setToolTip(record.folder)

    def select_runs(self, run_ids: Iterable[str]) -> None:
        self._select_ids(set(run_ids))  # the table's selection signal redraws the chart

    def _select_ids(self, run_ids: set[str]) -> None:
        """Select exactly the rows of ``run_ids``, in one step (``selectRow`` would keep only the last one)."""
        selection = QItemSelection()
        last = self.table.columnCount() - 1
        for row, record in enumerate(self.records):
            if record.id in run_ids:
                selection.select(self.table.model().index(row, 0), self.table.model().index(row, last))
        flags = QItemSelectionModel.SelectionFlag.ClearAndSelect | QItemSelectionModel.SelectionFlag.Rows
        self.table.selectionModel().select(selection, flags)

    def selected_records(self) -> list[RunRecord]:
        rows = sorted({index.row() for index in self.table.selectionModel().selectedRows()})
        return [self.records[row] for row in rows if row < len(self.records)]

    def _selection_changed(self) -> None:
        selected = self.selected_records()
        self.resume_button.setEnabled(len(selected) == 1 and selected[0].resumable)
        self.export_button.setEnabled(len(selected) == 1 and has_adapter(selected[0]))
        self.report_button.setEnabled(len(selected) == 1 and has_adapter(selected[0]))
        self.rename_button.setEnabled(len(selected) == 1)
        self.delete_button.setEnabled(len(selected) == 1)
        self.draw(selected)

    def draw(self, records: list[RunRecord]) -> None:
        """Overlay the train and eval loss of ``records``, one colour per run."""
        self.chart.clear()
        self.chart.getViewBox().enableAutoRange()  # fitted to the runs now selected
        self.curves: dict[str, LossCurves] = {}
        for index, record in enumerate(records):
            curves = read_curves(record.folder)
            self.curves[record.id] = curves
            colour = COLOURS[index % len(COLOURS)]
            self.chart.plot(curves.steps, curves.losses, pen=pg.mkPen(colour, width=2), name=f"{record.name} train")
            if curves.eval_steps:
                dashed = pg.mkPen(colour, width=1, style=Qt.PenStyle.DashLine)
                self.chart.plot(
                    curves.eval_steps,
                    curves.eval_losses,
                    pen=dashed,
                    symbol="o",
                    symbolBrush=colour,
                    symbolSize=6,
                    name=f"{record.name} eval",
                )

    # --------------------------------------------------------------------------------------------- actions

    def resume_selected(self) -> None:
        selected = self.selected_records()
        if len(selected) == 1 and selected[0].resumable:
            self.resume_requested.emit(selected[0].folder)

    def report_selected(self) -> None:
        selected = self.selected_records()
        if len(selected) == 1 and has_adapter(selected[0]):
            self.report_requested.emit(selected[0].folder)

    def export_selected(self) -> ExportDialog | None:
        """Open the export dialog for the selected run (it works in the background; the window stays usable)."""
        selected = self.selected_records()
        if len(selected) != 1 or not has_adapter(selected[0]):
            return None
        if self.export_dialog is not None and not self.export_dialog.busy():
            self.export_dialog.close()
        self.export_dialog = ExportDialog(selected[0].folder, selected[0].name, self)
        self.export_dialog.open()
        return self.export_dialog

    def rename_selected(self, name: str | None = None) -> None:
        """Rename the selected run to ``name``, or ask for the name in the rename dialog (OK waits for a good one)."""
        selected = self.selected_records()
        if len(selected) != 1:
            return
        record = selected[0]
        if name is None:
            self.rename_dialog = RenameDialog(record.name, self)
            dialog = self.rename_dialog
            dialog.accepted.connect(lambda: self._act(lambda: self._rename(record, dialog.name())))
            dialog.open()
            return
        self._act(lambda: self._rename(record, name))

    def _rename(self, record: RunRecord, name: str) -> str:
        self.registry.rename(record.id, name)
        return f"renamed to {name.strip()}"

    def confirm_delete(self, record: RunRecord) -> bool:
        """Ask before deleting; a separate method so that tests (and scripts) can answer for the user."""
        answer = QMessageBox.question(
            self,
            "Delete run",
            f"Delete the run “{record.name}”?\n\nWhat TuneDeck wrote in its folder {record.folder} (checkpoints, "
            "adapters, logs, report) and its record will be removed; files TuneDeck did not write stay, and so "
            "does the folder then. This cannot be undone.",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
            QMessageBox.StandardButton.No,
        )
        return answer == QMessageBox.StandardButton.Yes

    def delete_selected(self) -> None:
        selected = self.selected_records()
        if len(selected) != 1 or not self.confirm_delete(selected[0]):
            return
        self._act(lambda: self._delete(selected[0]))

    def _delete(self, record: RunRecord) -> str:
        removal = self.registry.delete(record.id)
        return "\n".join([f"deleted {record.name}", *(removal.lines() if removal is not None else [])])

    def _act(self, action: Callable[[], str]) -> None:
        """Run ``action``; show what it says it did, or its error."""
        try:
            done = action()
        except (TuneDeckError, OSError) as err:
            self.message.setText(f"error: {err}")
            return
        self.message.setText(done)
        self.refresh()
