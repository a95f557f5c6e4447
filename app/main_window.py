"""The main window: a list of pages on the left, the chosen page on the right. Navigation only.

Each page is its own panel module; the window builds them, hands them the shared state and the run controller,
and switches pages. Heavy modules (torch, transformers) are never imported here: hardware detection starts in
the background once the window is on screen, so it appears in well under three seconds.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import TracebackType

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import (
    QApplication,
    QHBoxLayout,
    QListWidget,
    QMainWindow,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from app.app_state import AppState
from app.data_panel import DataPanel
from app.guide import GuideBar
from app.hardware_panel import HardwarePanel
from app.icon import app_icon
from app.model_panel import ModelPanel
from app.run_charts import configure_plots
from app.run_controller import FAILED, FINISHED, RunController
from app.run_panel import RunPanel
from app.setup_panel import SetupPanel
from app.setup_view import SetupView, torch_missing
from app.speed_panel import SpeedPanel
from app.worker import TaskRunner, describe_error


class MainWindow(QMainWindow):
    """Pages: This computer, Model, Dataset, Recipe, Run, Speed, GPU setup (and Runs, Chat when installed), under
    the guide bar (Model → Data → Recipe → Start)."""

    def __init__(self, *, detect_on_show: bool = True) -> None:
        super().__init__()
        self.setWindowTitle("TuneDeck")
        self.setWindowIcon(app_icon())
        self.resize(1200, 780)
        configure_plots()
        self.state = AppState(self)
        self.tasks = TaskRunner(self)
        self.controller = RunController(self)
        self.hardware_panel = HardwarePanel(self.state, self.tasks)
        self.model_panel = ModelPanel(self.state, self.tasks)
        self.setup_panel = SetupPanel(self.state)
        self.data_panel = DataPanel(self.state, self.tasks, self.setup_panel.data_settings)
        self.run_panel = RunPanel(self.state, self.controller, self.setup_panel.build_config)
        self.speed_panel = SpeedPanel(self.state, self.controller)
        self.setup_view = SetupView(self.tasks)
        self.pages = QStackedWidget()
        self.nav = QListWidget()
        self.nav.setFixedWidth(170)
        self.nav.setStyleSheet("QListWidget { font-size: 14px; } QListWidget::item { padding: 8px 6px; }")
        self.nav.currentRowChanged.connect(self.pages.setCurrentIndex)
        pages = [
            ("This computer", self.hardware_panel),
            ("Model", self.model_panel),
            ("Dataset", self.data_panel),
            ("Recipe", self.setup_panel),
            ("Run", self.run_panel),
            ("Speed", self.speed_panel),
            ("GPU setup", self.setup_view),
        ]
        for title, page in [*pages, *optional_pages()]:
            self.add_page(title, page)
            if hasattr(page, "resume_requested"):  # the Runs page: resume a stopped run here
                page.resume_requested.connect(self.run_panel.resume_run)
            if hasattr(page, "refresh"):  # pages listing runs show a run's end at once, not at their next poll
                self.controller.state_changed.connect(lambda state, page=page: self._run_ended(state, page))
        self.run_panel.start_requested.connect(lambda: self.show_page("Run"))
        self.setup_view.installed.connect(lambda: None if torch_missing() else self.hardware_panel.detect())
        self.controller.telemetry.connect(self._telemetry_warning)
        guided = [("Model", "Model", self.model_panel), ("Data", "Dataset", self.data_panel),
                  ("Recipe", "Recipe", self.setup_panel)]  # fmt: skip
        self.guide = GuideBar(guided, self.controller)
        self.guide.page_requested.connect(self.show_page)
        self.guide.start_clicked.connect(self.run_panel.start)
        body = QWidget()
        column = QVBoxLayout(body)
        column.addWidget(self.guide)
        layout = QHBoxLayout()
        layout.addWidget(self.nav)
        layout.addWidget(self.pages, 1)
        column.addLayout(layout, 1)
        self.setCentralWidget(body)
        needs_torch = torch_missing()  # without torch, nothing but setup works: open there
        if needs_torch:
            self.show_page("GPU setup")
        else:
            self.nav.setCurrentRow(0)
        if detect_on_show:  # after the first paint, never before
            QTimer.singleShot(0, self.setup_view.refresh)
            if not needs_torch:
                QTimer.singleShot(0, self.hardware_panel.detect)

    def add_page(self, title: str, page: QWidget) -> None:
        self.nav.addItem(title)
        self.pages.addWidget(page)

    def show_page(self, title: str) -> None:
        items = self.nav.findItems(title, Qt.MatchFlag.MatchExactly)
        if items:
            self.nav.setCurrentItem(items[0])

    def _telemetry_warning(self, event: object) -> None:
        """Spill and throttling warnings also go to the status bar, seen from every page."""
        if type(event).__name__ == "TelemetryWarning":
            self.statusBar().showMessage(f"⚠ {getattr(event, 'message', '')}")

    def _run_ended(self, state: str, page: QWidget) -> None:
        if state in (FINISHED, FAILED):
            page.refresh()  # type: ignore[attr-defined]

    def page_titles(self) -> list[str]:
        return [self.nav.item(i).text() for i in range(self.nav.count())]

    def closeEvent(self, event: QCloseEvent) -> None:
        self.setup_view.shutdown()
        self.controller.shutdown()
        self.tasks.wait_all()
        super().closeEvent(event)


def optional_pages() -> list[tuple[str, QWidget]]:
    """The run history and chat pages, when their modules are present."""
    found: list[tuple[str, QWidget]] = []
    for title, module, cls in (("Runs", "app.runs_view", "RunsView"), ("Chat", "app.chat_view", "ChatView")):
        try:
            widget_type = getattr(__import__(module, fromlist=[cls]), cls)
        except (ImportError, AttributeError):
            continue
        found.append((title, widget_type()))
    return found


def run_app(argv: Sequence[str]) -> int:
    existing = QApplication.instance()
    app = existing if isinstance(existing, QApplication) else QApplication(list(argv))
    app.setApplicationName("TuneDeck")
    app.setWindowIcon(app_icon())
    window = MainWindow()
    install_error_hook(window)
    window.show()
    return app.exec()


def install_error_hook(window: MainWindow) -> None:
    """A bug in a slot must not end the session silently: say it in the window, keep the details on stderr."""
    previous = sys.excepthook

    def show(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        previous(kind, error, trace)
        info = describe_error(error)
        window.statusBar().showMessage(
            f"Something went wrong: {info.message}" + (f" — {info.hint}" if info.hint else "")
        )

    sys.excepthook = show


if __name__ == "__main__":
    sys.exit(run_app(sys.argv))
