"""The window as a whole: remembered size, position and page; one header style on every page; the light and dark
looks with charts coloured from the palette; collapsed notices; Chat and Runs refreshed when a run ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyqtgraph as pg
import pytest
from PySide6.QtCore import QSettings, Qt
from PySide6.QtGui import QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QLabel
from test_chat import train_tiny_run

from app.background import run_controller as rc
from engine.events import CheckpointSaved, Notice
from engine.run.registry import Registry

pytest_plugins = ["app_fixtures"]


def open_window(qtbot: Any, settings_file: Path) -> Any:
    from app.main_window import MainWindow

    win = MainWindow(detect_on_show=False, settings=QSettings(str(settings_file), QSettings.Format.IniFormat))
    qtbot.addWidget(win)
    win.show()
    return win


def test_the_window_remembers_its_size_position_and_page(qtbot: Any, tmp_path: Path) -> None:
    settings = tmp_path / "window.ini"
    first = open_window(qtbot, settings)
    from app.main_window import default_size

    least, (width, height) = first.minimumSizeHint(), default_size()
    expected = (max(width, least.width()), max(height, least.height()))  # a screen under 870 pixels: the smallest
    assert (first.width(), first.height()) == expected, "a first start gets the default size"
    # another size that fits the screen (windows never outgrow it)
    size = (max(least.width(), first.width() - 17), max(least.height(), first.height() - 61))
    first.resize(*size)
    first.move(11, 44)  # still on an 800-pixel screen with the window at its smallest
    first.show_page("Speed")
    first.close()
    second = open_window(qtbot, settings)
    assert (second.width(), second.height()) == size
    assert (second.x(), second.y()) == (first.x(), first.y())
    assert second.current_page() == "Speed" and second.pages.currentIndex() == second.page_titles().index("Speed")
    second.close()


def test_the_default_settings_location_is_never_the_users_in_tests() -> None:
    from app.main_window import app_settings

    location = Path(app_settings().fileName())
    assert location.name == "TuneDeck.ini"
    assert not location.is_relative_to(Path.home() / ".config")


def test_every_page_has_the_same_header(window: Any) -> None:
    from app.widgets.page_header import Page

    for index, title in enumerate(window.page_titles()):
        page = window.pages.widget(index)
        assert isinstance(page, Page) and page.panel is window.page(title)
        assert page.header.title.text() == title
        assert len(page.header.text.text()) > 30, f"{title}: one line saying what the page is for"
        titles = [label.text() for label in page.panel.findChildren(QLabel) if "<h2>" in label.text()]
        assert titles == [], f"{title} carries a second title: {titles}"


def plot_colors(plot: pg.PlotWidget) -> tuple[int, int]:
    """Lightness of a chart's background and of its axis text."""
    background = plot.backgroundBrush().color().lightness()
    return background, plot.getPlotItem().getAxis("left").textPen().color().lightness()


def test_light_and_dark_looks_colour_the_widgets_and_every_chart(window: Any) -> None:
    plots = window.findChildren(pg.PlotWidget)
    assert len(plots) >= 5, "the run charts and the runs chart"
    window.set_look(True)
    palette = QApplication.instance().palette()
    assert palette.color(QPalette.ColorRole.Window).lightness() < 80
    assert palette.color(QPalette.ColorRole.WindowText).lightness() > 180
    for plot in plots:
        background, text = plot_colors(plot)
        assert background < 80 and text > 180
    QApplication.processEvents()  # the palette reaches the widgets through posted events
    assert window.page("Runs").palette().color(QPalette.ColorRole.Window).lightness() < 80
    window.set_look(False)
    assert QApplication.instance().palette().color(QPalette.ColorRole.Window).lightness() > 180
    for plot in plots:
        background, text = plot_colors(plot)
        assert background > 180 and text < 80


def test_the_look_follows_the_system_color_scheme(window: Any) -> None:
    hints = QGuiApplication.styleHints()
    try:  # the offscreen platform has no system theme to switch: send its change signal as a desktop would
        hints.colorSchemeChanged.emit(Qt.ColorScheme.Dark)
        assert window.dark and QApplication.instance().palette().color(QPalette.ColorRole.Base).lightness() < 80
        hints.colorSchemeChanged.emit(Qt.ColorScheme.Light)
        assert not window.dark
    finally:
        window.set_look(False)


def test_notices_collapse_to_the_last_checkpoint_and_counted_repeats(window: Any) -> None:
    panel = window.run_panel
    for step in (20, 40, 60):
        panel.on_event(CheckpointSaved(step, f"/runs/x/checkpoints/step-{step}"))
    for _ in range(3):
        panel.on_event(Notice("the tokenizer has no pad token; using eos"))
    panel._add_warning("the GPU is throttling")
    panel._add_warning("the GPU is throttling")
    assert panel.warnings.messages() == [
        "⚠ the GPU is throttling  (×2)",
        "Note: the tokenizer has no pad token; using eos  (×3)",
        "Last checkpoint: step 60",
    ]
    panel.on_event(CheckpointSaved(80, "/runs/x/checkpoints/step-80"))
    assert panel.warnings.messages()[0] == "Last checkpoint: step 80" and panel.warnings.count() == 3


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_model_dir, tmp_path_factory.mktemp("window-refresh"))


@pytest.mark.parametrize("end", [rc.FINISHED, rc.FAILED])
def test_chat_and_runs_list_a_run_as_soon_as_it_ends(window: Any, finished_run: Path, end: str) -> None:
    chat, runs = window.page("Chat"), window.page("Runs")
    assert chat.runs.count() == 0 and runs.table.rowCount() == 0
    Registry().upsert(finished_run, name="ended just now", status="finished", model="tiny-llama")
    window.controller._set_state(rc.RUNNING)
    assert chat.runs.count() == 0, "nothing is re-read while the run goes on"
    window.controller._set_state(end)  # the run finished, was stopped (it ends as finished) or failed
    assert chat.runs.count() == 1 and "ended just now" in chat.runs.itemText(0)
    assert chat.load_button.isEnabled()
    assert runs.table.rowCount() == 1 and runs.table.item(0, 0).text() == "ended just now"


def test_the_window_fits_a_laptop_screen_whatever_the_page(window: Any) -> None:
    """No page makes the window taller or wider than a 1366x768 screen leaves room for: tall panels scroll."""
    hint = window.minimumSizeHint()
    assert hint.width() <= 1366 * 0.9 and hint.height() <= 728 * 0.9, hint
