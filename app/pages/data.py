"""Dataset page: format, counts, a token-length histogram, packing efficiency, bad rows and a preview.

The preview highlights the tokens the loss is computed on, so a user sees what the model learns from (only the
answers of a chat, unless "train on all tokens" is set).
"""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QPushButton,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.app_state import AppState
from app.background.worker import ErrorInfo, TaskRunner
from app.theme import ERROR_COLOR, current_chart_colors, style_plot
from app.widgets.page_chart import PageChart
from engine.config import DEMO_MODEL, DataConfig
from engine.model.hub import OFFLINE_MODE
from engine.run.data_report import NO_TOKENIZER, DatasetReport, analyze_dataset

TRAINED_STYLE = "background:#c8f0d0;color:#0b3d17"
PROMPT_STYLE = "color:#777"


def demo_data_file() -> Path:
    """The demo dataset, found without importing engine.demo (which loads torch)."""
    import resources

    return Path(resources.__file__).parent / "demo" / "data" / "train.jsonl"


def preview_html(pieces: list[tuple[str, bool]], pictures: list[str] | None = None) -> str:
    """One previewed example: its pictures as thumbnails (image datasets), then its text, the learned part
    highlighted."""
    thumbnails = "".join(
        f"<img src='{html.escape(Path(picture).as_uri())}' height='{THUMBNAIL_HEIGHT}'> " for picture in pictures or []
    )
    spans = "".join(
        f"<span style='{TRAINED_STYLE if trained else PROMPT_STYLE}'>{html.escape(text)}</span>"
        for text, trained in pieces
    )
    return (f"<p>{thumbnails}</p>" if thumbnails else "") + f"<pre style='white-space:pre-wrap'>{spans}</pre>"


THUMBNAIL_HEIGHT = 72


class LengthHistogram(PageChart):
    """Tokens per example as bars in the palette's accent on the chart's own background, redrawn in the new colours
    when the look changes (bars of a fixed colour sank into the dark background)."""

    def __init__(self) -> None:
        super().__init__(title="Tokens per example")
        self.setLabel("bottom", "tokens")
        self.setLabel("left", "examples")
        self.lengths: list[int] = []
        self.bars: pg.BarGraphItem | None = None
        self.restyle()

    def draw(self, lengths: list[int]) -> None:
        self.lengths = list(lengths)
        self.clear()
        self.bars = None
        if not lengths:
            return
        colors = current_chart_colors()
        counts, edges = np.histogram(lengths, bins=min(30, max(5, len(set(lengths)))))
        # the bars' outline is the background, so neighbouring bars stay apart in either look
        self.bars = pg.BarGraphItem(x0=edges[:-1], x1=edges[1:], height=counts, brush=colors.accent,
                                    pen=pg.mkPen(colors.background, width=1))  # fmt: skip
        self.addItem(self.bars)

    def restyle(self) -> None:
        style_plot(self, current_chart_colors())
        if self.lengths:
            self.draw(self.lengths)


class DataPanel(QWidget):
    """Open a dataset file or folder and see what training will make of it."""

    changed = Signal()
    """The step's status changed (the guide bar listens)."""

    def __init__(
        self, state: AppState, tasks: TaskRunner, data_settings: Callable[[str], DataConfig] | None = None
    ) -> None:
        super().__init__()
        self.state, self.tasks = state, tasks
        self.data_settings = data_settings or (lambda path: DataConfig(path=path))
        self.report_model: str | None = None
        self.problem = ""
        self.loads = 0
        self.auto_demo = False
        """The demo dataset was picked for the demo model, not by the user."""
        state.model_changed.connect(self._model_changed)
        self.path_edit = QLineEdit(placeholderText=".jsonl / .json / .csv / .parquet file, or a saved dataset folder")
        open_file = QPushButton("Open file…")
        open_file.clicked.connect(self._open_file)
        open_folder = QPushButton("Open folder…")
        open_folder.clicked.connect(self._open_folder)
        load = QPushButton("Load")
        load.clicked.connect(lambda: self.load(self.path_edit.text().strip()))
        demo = QPushButton("Demo data")
        demo.setToolTip("the built-in demo task: dates in many formats -> ISO dates")
        demo.clicked.connect(lambda: self.load(str(demo_data_file())))
        self.summary = QLabel("No dataset yet.")
        self.summary.setWordWrap(True)
        self.fetch = QPushButton("Look up the tokenizer on the hub")
        self.fetch.setToolTip("The only request this page sends: the model's tokenizer files, a few MB")
        self.fetch.clicked.connect(lambda: self.load(self.path_edit.text().strip(), auto=self.auto_demo, use_hub=True))
        self.fetch.hide()
        self.histogram = LengthHistogram()
        self.problems = QListWidget()
        self.preview = QTextBrowser()
        top = QHBoxLayout()
        for widget in (self.path_edit, open_file, open_folder, load, demo):
            top.addWidget(widget)
        left = QSplitter(Qt.Orientation.Vertical)
        left.addWidget(self.histogram)
        left.addWidget(_titled("Rows that cannot be used", self.problems))
        body = QSplitter()
        body.addWidget(left)
        body.addWidget(_titled("Preview (highlighted: tokens the model learns to predict)", self.preview))
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.summary)
        layout.addWidget(self.fetch, 0, Qt.AlignmentFlag.AlignLeft)
        layout.addWidget(body, 1)

    def load(self, path: str, *, auto: bool = False, use_hub: bool = False) -> None:
        """Read ``path`` in the background; ``auto``: picked by TuneDeck (the demo data for the demo model);
        ``use_hub``: the user asked to fetch the model's tokenizer (otherwise only what is on disk is read)."""
        self.auto_demo = auto
        self.problem = ""
        self.fetch.hide()
        if not path:
            self.summary.setText("Choose a file or folder first.")
            return
        self.path_edit.setText(path)
        model, settings = self.state.model_name, self.data_settings(path)
        self.summary.setText(f"Looking up {model}'s tokenizer on the hub…" if use_hub else f"Reading {path}…")
        self.changed.emit()
        self.report_model = model
        self.loads += 1
        load = self.loads  # only the latest load may report: an earlier one's result or error is stale
        self.tasks.start(lambda: analyze_dataset(path, model, settings, use_hub=use_hub),
                         lambda report: self.show_report(report) if load == self.loads else None,
                         lambda error: self._show_error(error) if load == self.loads else None)  # fmt: skip

    def show_report(self, report: DatasetReport) -> None:
        share = report.trained_tokens / max(report.total_tokens, 1)
        self.summary.setText(
            f"Format <b>{report.data_format}</b> · {report.rows:,} rows, {report.good_rows:,} usable, "
            f"{len(report.problems):,} with problems · {report.total_tokens:,} tokens, {share:.0%} trained · "
            + _rows_text(report)
            + (" · figures from the first examples" if report.sampled else "")
            + ("<br>The demo dataset, selected for the demo model: open your own file to replace it."
               if self.auto_demo else "")
        )  # fmt: skip
        self.histogram.draw(report.lengths)
        self.problems.clear()
        for row, field, message in report.problems:
            self.problems.addItem(f"row {row}: {field}: {message}")
        if not report.problems:
            self.problems.addItem("none: every row can be used")
        pictures = report.thumbnails or [[] for _ in report.preview]
        shown = zip(report.preview, pictures, strict=True)
        self.preview.setHtml("<hr>".join(preview_html(pieces, files) for pieces, files in shown))
        self.state.set_data(report.path, report)
        self.changed.emit()

    def step_status(self) -> tuple[bool, str]:
        """(ready, what to say) for the guide bar."""
        report = self.state.data_report
        if self.problem.startswith(NO_TOKENIZER):
            return False, f"Waiting for the model: {self.problem}"
        if self.problem:
            return False, f"Choose another dataset ({self.problem})"
        if self.summary.text().startswith("Looking up"):
            return False, self.summary.text()
        if self.summary.text().startswith("Reading"):
            return False, f"Reading {Path(self.path_edit.text()).name}…"
        if report is not None and self.state.data_path:
            demo = " (the demo data)" if self.auto_demo else ""
            return True, f"{Path(report.path).name}: {report.good_rows:,} examples{demo}"
        if self.state.model_name == DEMO_MODEL:
            return False, "Choose a dataset (the demo model brings its own)"
        return False, "Choose a dataset: a .jsonl, .json, .csv or .parquet file"

    def _model_changed(self) -> None:
        """Token counts and the preview depend on the tokenizer: redo them for a newly chosen model."""
        known = self.state.model_info is not None
        shown = self.path_edit.text().strip()
        if known and self.state.model_name == DEMO_MODEL and (self.auto_demo or not shown):
            if shown != str(demo_data_file()) or self.report_model != DEMO_MODEL:
                self.load(str(demo_data_file()), auto=True)
        elif known and self.state.data_path and self.report_model not in (None, self.state.model_name):
            self.load(self.state.data_path, auto=self.auto_demo)

    def _show_error(self, error: ErrorInfo) -> None:
        self.problem = error.message
        self.histogram.draw([])  # what an earlier read (another model, another file) found is not so of this one
        self.problems.clear()
        self.preview.clear()
        if error.message.startswith(NO_TOKENIZER) and OFFLINE_MODE not in error.message:  # ask the hub first
            self.fetch.setText(f"Look up {self.report_model}'s tokenizer on the hub")
            self.fetch.show()
        self.changed.emit()
        self.summary.setText(
            f"<span style='color:{ERROR_COLOR}'>{html.escape(error.message)}</span>"
            + (f"<br>What to do: {html.escape(error.hint)}" if error.hint else "")
        )

    def _open_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Dataset", "", "Datasets (*.jsonl *.json *.csv *.parquet)")
        if path:
            self.load(path)

    def _open_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Saved dataset folder")
        if path:
            self.load(path)


def _rows_text(report: DatasetReport) -> str:
    """How the examples become micro-batches: packed rows of text, or padded rows of pictures and text."""
    if report.images:
        return (
            f"{report.images:,} images, {report.image_tokens:,} image tokens · {report.packed_rows:,} padded "
            f"micro-batches of up to {report.tokens_per_batch:,} tokens, {report.packing_efficiency:.0%} not padding"
        )
    return (
        f"{report.packed_rows:,} packed rows of {report.tokens_per_batch:,} tokens, "
        f"packing efficiency <b>{report.packing_efficiency:.0%}</b>"
    )


def _titled(title: str, widget: QWidget) -> QWidget:
    box = QWidget()
    layout = QVBoxLayout(box)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.addWidget(QLabel(f"<b>{title}</b>"))
    layout.addWidget(widget)
    return box
