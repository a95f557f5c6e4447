"""The main window: a list of pages on the left, the chosen page on the right. Navigation only.

Each page is its own panel module; the window builds them, hands them the shared state and the run controller,
puts each under the common page header, and switches pages. Heavy modules (torch, transformers) are never
imported here: hardware detection starts in the background once the window is on screen, so it appears in well
under three seconds. The window keeps its size, position and page between sessions (QSettings) and follows the
system's light or dark look.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import TracebackType

from PySide6.QtCore import QSettings, Qt, QTimer
from PySide6.QtGui import QCloseEvent, QGuiApplication
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
from app.background.gui_gc import collect_on_gui_thread
from app.background.run_controller import FAILED, FINISHED, RunController
from app.background.worker import TaskRunner, describe_error
from app.icon import app_icon
from app.pages.data import DataPanel
from app.pages.export import ExportDialog
from app.pages.gpu_setup import SetupView, torch_missing
from app.pages.hardware import HardwarePanel
from app.pages.model import ModelPanel
from app.pages.recipe import SetupPanel
from app.pages.report import ReportPage
from app.pages.run import RunPanel
from app.pages.speed import SpeedPanel
from app.theme import apply_look, style_plots, system_is_dark
from app.widgets.guide import GuideBar, GuidedPage
from app.widgets.page_header import Page
from engine.hardware.allocator import set_at_process_start
from engine.run.estimate import MeasuredRow
from engine.run.registry import Registry, RunRecord
from engine.run.summary import measured_rows

DEFAULT_SIZE = (1280, 820)
EXPORT_WAIT_MS = 30 * 60 * 1000
"""How long closing the window waits for an export still running (a merge of a large model takes minutes)."""
NAV_STYLE = "QListWidget { font-size: 14px; } QListWidget::item { padding: 8px 6px; }"


def default_size() -> tuple[int, int]:
    """The first start's size: 1280x820, or nine tenths of a smaller screen."""
    screen = QGuiApplication.primaryScreen()
    if screen is None:
        return DEFAULT_SIZE
    room = screen.availableGeometry()
    return min(DEFAULT_SIZE[0], int(room.width() * 0.9)), min(DEFAULT_SIZE[1], int(room.height() * 0.9))


def app_settings() -> QSettings:
    """Where the window keeps its state: an INI file in the user's configuration folder."""
    return QSettings(QSettings.Format.IniFormat, QSettings.Scope.UserScope, "TuneDeck", "TuneDeck")


class MainWindow(QMainWindow):
    """Pages: This computer, Model, Dataset, Recipe, Run, Speed, Report, GPU setup (and Runs, Chat when installed),
    under the guide bar (Model → Data → Recipe → Start)."""

    def __init__(self, *, detect_on_show: bool = True, settings: QSettings | None = None) -> None:
        super().__init__()
        self.setWindowTitle("TuneDeck")
        self.setWindowIcon(app_icon())
        self.settings = settings if settings is not None else app_settings()
        self.dark = system_is_dark()
        apply_look(self.dark)  # before the charts are built: they take the palette's colours
        self.state = AppState(self)
        self.tasks = TaskRunner(self)
        self.controller = RunController(self)
        # the run's summary follows the controller before any page does, so every page reads the same figures
        self.controller.run_event.connect(self.state.follow_event)
        self.controller.state_changed.connect(self.state.follow_state)
        self.hardware_panel = HardwarePanel(self.state, self.tasks)
        self.model_panel = ModelPanel(self.state, self.tasks)
        self.setup_panel = SetupPanel(self.state, self.tasks)
        self.data_panel = DataPanel(self.state, self.tasks, self.setup_panel.data_settings)
        self.run_panel = RunPanel(self.state, self.controller, self.setup_panel.build_config)
        self.speed_panel = SpeedPanel(self.state, self.controller)
        self.setup_view = SetupView(self.tasks)
        self.report_page = ReportPage(self.tasks)
        self.pages = QStackedWidget()
        self.nav = QListWidget()
        self.nav.setFixedWidth(170)
        self.nav.setStyleSheet(NAV_STYLE)
        self.nav.currentRowChanged.connect(self.pages.setCurrentIndex)
        self._panels: dict[str, QWidget] = {}
        pages = [
            ("This computer", self.hardware_panel),
            ("Model", self.model_panel),
            ("Dataset", self.data_panel),
            ("Recipe", self.setup_panel),
            ("Run", self.run_panel),
            ("Speed", self.speed_panel),
            ("Report", self.report_page),
            ("GPU setup", self.setup_view),
        ]
        for title, page in [*pages, *optional_pages()]:
            self.add_page(title, page)
            if hasattr(page, "resume_requested"):  # the Runs page: resume a stopped run here
                page.resume_requested.connect(self.run_panel.resume_run)
            if hasattr(page, "report_requested"):  # the Runs page: any run's before/after report
                page.report_requested.connect(self.open_report)
            if hasattr(page, "train_requested"):  # the Chat page: a DPO run on the preferences saved there
                page.train_requested.connect(self.run_panel.start_config)
            if hasattr(page, "history_changed"):  # the Runs page's run list: the one source of which runs exist
                page.history_changed.connect(self._follow_history)
        self._follow_reports()
        self.controller.state_changed.connect(self._run_ended)
        self.state.run_changed.connect(self._show_live_run)
        self.load_measured_runs()
        self.run_panel.start_requested.connect(lambda: self.show_page("Run"))
        self.setup_view.installed.connect(lambda: None if torch_missing() else self.hardware_panel.detect())
        self.controller.telemetry.connect(self._telemetry_warning)
        guided: list[tuple[str, str, GuidedPage]] = [
            ("Model", "Model", self.model_panel), ("Data", "Dataset", self.data_panel),
            ("Recipe", "Recipe", self.setup_panel),
        ]  # fmt: skip
        self.guide = GuideBar(guided, self.controller, self.state)
        self.guide.page_requested.connect(self.show_page)
        self.guide.start_clicked.connect(self.run_panel.start)
        self.guide.ready_changed.connect(self.run_panel.show_readiness)  # the Run page says what the guide says
        self.run_panel.show_readiness(self.guide.ready_text)
        body = QWidget()
        column = QVBoxLayout(body)
        column.addWidget(self.guide)
        layout = QHBoxLayout()
        layout.addWidget(self.nav)
        layout.addWidget(self.pages, 1)
        column.addLayout(layout, 1)
        self.setCentralWidget(body)
        hints = QGuiApplication.styleHints()
        if hints is not None:  # the system switched between light and dark while the app is open
            hints.colorSchemeChanged.connect(self._scheme_changed)
        needs_torch = torch_missing()  # without torch, nothing but setup works: open there
        self.restore_state(first_page="GPU setup" if needs_torch else None)
        if detect_on_show:  # after the first paint, never before
            QTimer.singleShot(0, self.setup_view.refresh)
            if not needs_torch:
                QTimer.singleShot(0, self.hardware_panel.detect)

    def _follow_reports(self) -> None:
        """A run that ends here gets its before/after report in the background; the Run page says where it is."""
        self.controller.run_over.connect(self.report_page.follow_run)
        self.report_page.building.connect(self.run_panel.report_building)
        self.report_page.ready.connect(self.run_panel.report_ready)
        self.report_page.failed.connect(self.run_panel.report_failed)
        self.run_panel.open_report_requested.connect(self.open_report)

    def open_report(self, folder: str) -> None:
        """The Report page with ``folder``'s report (measured first where the run has none)."""
        self.report_page.open_run(folder)
        self.show_page("Report")

    def add_page(self, title: str, page: QWidget) -> None:
        self.nav.addItem(title)
        self.pages.addWidget(Page(title, page))  # it scrolls where the window is smaller than it
        self._panels[title] = page

    def page(self, title: str) -> QWidget | None:
        """The panel shown under ``title`` (None when the page is not installed)."""
        return self._panels.get(title)

    def show_page(self, title: str) -> None:
        items = self.nav.findItems(title, Qt.MatchFlag.MatchExactly)
        if items:
            self.nav.setCurrentItem(items[0])

    def current_page(self) -> str:
        item = self.nav.currentItem()
        return item.text() if item is not None else ""

    def set_look(self, dark: bool) -> None:
        """Light or dark: the palette for every widget, and every chart recoloured from it."""
        self.dark = dark
        apply_look(dark)
        for widget in self.findChildren(QWidget):  # a widget with a style sheet keeps the colours it was polished
            sheet = widget.styleSheet()  # with: set its sheet again to take the new palette
            if sheet:
                widget.setStyleSheet("")
                widget.setStyleSheet(sheet)
        style_plots([self])

    def _scheme_changed(self, scheme: Qt.ColorScheme) -> None:
        self.set_look(scheme == Qt.ColorScheme.Dark)

    def _telemetry_warning(self, event: object) -> None:
        """Spill and throttling warnings also go to the status bar, seen from every page."""
        if type(event).__name__ == "TelemetryWarning":
            self.statusBar().showMessage(f"⚠ {getattr(event, 'message', '')}")

    def load_measured_runs(self) -> None:
        """Earlier runs' speeds on this machine, for the time estimates before Start (read in the background: each
        run's step log is read)."""
        self.tasks.start(lambda: measured_rows(Registry().runs()), self._measured_runs_read, lambda _error: None)

    def _measured_runs_read(self, rows: list[MeasuredRow]) -> None:
        self.state.measured = rows
        self.setup_panel.check_fit()

    def _show_live_run(self) -> None:
        """The run going on, on the pages that list runs (their own reading of the history lags behind it)."""
        for title in ("Runs", "Chat"):
            page = self.page(title)
            if page is not None and hasattr(page, "show_live"):
                page.show_live(self.state.run)

    def _follow_history(self, records: list[RunRecord]) -> None:
        """Every page that names a run follows the run list: a deleted run leaves them, a renamed one is renamed."""
        self.run_panel.follow_history(records)
        chat = self.page("Chat")
        if chat is not None:
            chat.show_runs(records)  # type: ignore[attr-defined]

    def _run_ended(self, state: str) -> None:
        """Pages listing runs show a run's end (finished, stopped or failed) at once, not at their next poll."""
        if state not in (FINISHED, FAILED):
            return
        self.load_measured_runs()
        runs, chat = self.page("Runs"), self.page("Chat")
        if runs is not None:
            runs.refresh()  # type: ignore[attr-defined]
        if chat is not None:
            chat.refresh_runs()  # type: ignore[attr-defined]

    def page_titles(self) -> list[str]:
        return [self.nav.item(i).text() for i in range(self.nav.count())]

    def restore_state(self, first_page: str | None = None) -> None:
        """Size, position and page as the user left them; ``first_page`` wins over the remembered page."""
        geometry = self.settings.value("window/geometry")
        if geometry is None or not self.restoreGeometry(geometry):
            self.resize(*default_size())
        page = first_page or str(self.settings.value("window/page", "") or "")
        if page in self.page_titles():
            self.show_page(page)
        else:
            self.nav.setCurrentRow(0)

    def save_state(self) -> None:
        self.settings.setValue("window/geometry", self.saveGeometry())
        self.settings.setValue("window/page", self.current_page())
        self.settings.sync()

    def closeEvent(self, event: QCloseEvent) -> None:
        self.save_state()
        self.setup_view.shutdown()
        self.controller.shutdown()
        self.report_page.shut_down()
        self.tasks.wait_all()
        for dialog in self.findChildren(ExportDialog):  # an export half-way finishes before the window goes
            dialog.tasks.wait_all(EXPORT_WAIT_MS)
        super().closeEvent(event)


def optional_pages() -> list[tuple[str, QWidget]]:
    """The run history and chat pages, when their modules are present."""
    found: list[tuple[str, QWidget]] = []
    for title, module, cls in (("Runs", "app.pages.runs", "RunsView"), ("Chat", "app.pages.chat", "ChatView")):
        try:
            widget_type = getattr(__import__(module, fromlist=[cls]), cls)
        except (ImportError, AttributeError):
            continue
        found.append((title, widget_type()))
    return found


def run_app(argv: Sequence[str]) -> int:
    set_at_process_start()  # before the hardware detection below starts CUDA (app.__main__ has done it too)
    existing = QApplication.instance()
    app = existing if isinstance(existing, QApplication) else QApplication(list(argv))
    app.setApplicationName("TuneDeck")
    app.setWindowIcon(app_icon())
    collect_on_gui_thread(app)  # worker threads must never be the ones that destroy widgets
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
