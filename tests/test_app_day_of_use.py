"""After a day of real use: on a 1366x768 laptop screen and at the window's smallest size, every page still fits,
agrees with the others and follows the run history (a demo run just ended, runs deleted and renamed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from app_demo import prepare_demo
from hang import HANG_MS
from PySide6.QtCore import QPoint, QPointF, QSize, Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import QAbstractButton, QApplication, QLabel, QScrollArea, QWidget

from app.background import run_controller as rc

pytest_plugins = ["app_fixtures"]

LAPTOP = QSize(1366, 768)


def run_demo(qtbot: Any, window: Any, steps: int = 3) -> str:
    """A short demo run started from the Run page, to its end and its before/after report; its folder."""
    prepare_demo(qtbot, window, max_steps=steps)
    window.resize(LAPTOP)
    window.run_panel.start_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.FINISHED, timeout=HANG_MS)
    panel = window.run_panel
    qtbot.waitUntil(lambda: panel.open_report_button.isVisible() or "No before" in panel.report_status.text(),
                    timeout=HANG_MS)  # fmt: skip
    assert panel.ended_run is not None
    return panel.ended_run


def cut_off(page: Any, scroll: QScrollArea) -> list[str]:
    """What a user cannot read on ``page``: buttons narrower than their text or outside the visible part of the
    page, word-wrapped labels shorter than their text."""
    viewport = scroll.viewport()
    problems = []
    for button in page.findChildren(QAbstractButton):
        if not button.isVisibleTo(page):
            continue
        if button.width() < button.sizeHint().width():
            problems.append(f"button {button.text()!r} is {button.width()} wide, needs {button.sizeHint().width()}")
        room = viewport if scroll.isAncestorOf(button) else page  # what scrolls, or what stays put below it
        right = button.mapTo(room, QPoint(button.width(), 0)).x()
        if right > room.width():
            problems.append(f"button {button.text()!r} ends at {right}, past the page's {room.width()}")
    for label in page.findChildren(QLabel):
        if label.isVisibleTo(page) and label.wordWrap() and label.text():
            needed = label.heightForWidth(label.contentsRect().width()) + label.height() - label.contentsRect().height()
            if label.height() < needed:
                problems.append(f"label {label.text()[:60]!r} is {label.height()} high, needs {needed}")
    if scroll.horizontalScrollBar().isVisible():
        problems.append("a horizontal scrollbar")
    return problems


def test_the_run_page_fits_after_a_run_on_a_laptop_and_at_the_smallest_size(qtbot: Any, window: Any) -> None:
    run_demo(qtbot, window)
    window.show_page("Run")
    scroll = window.pages.currentWidget().findChild(QScrollArea)
    for size in (LAPTOP, window.minimumSizeHint()):
        window.resize(size)
        wanted = size.expandedTo(window.minimumSizeHint())
        qtbot.waitUntil(lambda wanted=wanted: window.size() == wanted)
        qtbot.wait(50)  # layouts settle on the next passes of the event loop
        assert cut_off(window.run_panel, scroll) == [], f"at {size.toTuple()}"


def chat_names(window: Any) -> dict[str, str]:
    chat = window.page("Chat")
    return {chat.runs.itemData(i): chat.runs.itemText(i) for i in range(chat.runs.count())}


def test_pages_follow_the_run_list_when_a_run_is_renamed_then_deleted(
    qtbot: Any, window: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = run_demo(qtbot, window)
    runs, panel = window.page("Runs"), window.run_panel
    assert folder in chat_names(window) and panel.export_button.isEnabled()
    record = next(record for record in runs.records if record.folder == folder)
    runs.select_runs([record.id])
    runs.rename_selected("dates-v2")
    assert chat_names(window)[folder].startswith("dates-v2"), chat_names(window)
    monkeypatch.setattr(runs, "confirm_delete", lambda record: True)  # the user answers Yes
    runs.delete_selected()
    assert not Path(folder, "adapter").exists()
    assert folder not in chat_names(window)
    assert not panel.open_report_button.isVisibleTo(panel) and not panel.export_button.isEnabled()
    assert "deleted" in panel.status.text()


def test_the_report_page_shows_a_finished_runs_report_without_open_report(qtbot: Any, window: Any) -> None:
    report_page = window.page("Report")
    folder = run_demo(qtbot, window)
    assert window.run_panel.open_report_button.isVisible()  # written; Open report is not pressed
    window.show_page("Report")
    qtbot.waitUntil(lambda: report_page.report is not None and not report_page.busy(), timeout=HANG_MS)
    assert report_page.folder == folder and Path(folder).name in report_page.heading.text()
    assert "No report shown yet" not in report_page.status.text() and report_page.figures.isVisible()


def wheel_down(widget: Any) -> None:
    """One notch of the mouse wheel over the middle of ``widget`` (a chart: its viewport gets the event)."""
    target = widget.viewport() if hasattr(widget, "viewport") else widget
    middle = QPointF(target.width() / 2, target.height() / 2)
    event = QWheelEvent(middle, target.mapToGlobal(middle), QPoint(), QPoint(0, -120), Qt.MouseButton.NoButton,
                        Qt.KeyboardModifier.NoModifier, Qt.ScrollPhase.NoScrollPhase, False)  # fmt: skip
    QApplication.sendEvent(target, event)


def test_the_wheel_scrolls_the_run_page_and_each_run_starts_with_its_charts_fitted(qtbot: Any, window: Any) -> None:
    run_demo(qtbot, window)
    charts = window.run_panel.charts
    speed = charts.speed.getViewBox()
    speed.setYRange(-200_000, -100_000)  # zoomed by hand, far from any speed this run or the next has
    window.resize(window.minimumSizeHint())  # the page scrolls at the window's smallest size
    window.show_page("Run")
    scroll = window.pages.currentWidget().findChild(QScrollArea)
    qtbot.waitUntil(lambda: scroll.verticalScrollBar().maximum() > 0)
    before = [plot.getViewBox().viewRange() for plot in (charts.loss, charts.speed)]
    for plot in (charts.loss, charts.speed):
        scroll.ensureWidgetVisible(plot, 0, 0)
        position = scroll.verticalScrollBar().value()
        wheel_down(plot)
        assert scroll.verticalScrollBar().value() > position or position == scroll.verticalScrollBar().maximum()
    assert [plot.getViewBox().viewRange() for plot in (charts.loss, charts.speed)] == before, "a chart zoomed"
    window.resize(LAPTOP)
    window.run_panel.start_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.FINISHED, timeout=HANG_MS)
    speeds = charts.buffers["speed"]

    def fitted() -> bool:  # the chart follows its data on its next redraw
        low, high = speed.viewRange()[1]
        return bool(speeds) and low <= min(speeds) and max(speeds) <= high

    qtbot.waitUntil(fitted)


def held_out_questions(run_folder: str) -> set[str]:
    """The questions of the examples the run held out (as the run's data preparation chose them)."""
    from engine.config import RunConfig
    from engine.data.files import load_examples
    from engine.data.split import first_question, split_examples

    config = RunConfig.load(Path(run_folder) / "config.json")
    examples, _ = load_examples(config.data.path, config.data.format)
    held_out = split_examples(examples, config.data.eval_fraction, config.training.seed)[1]
    assert held_out, "the demo run holds examples out"
    return {first_question(example) for example in held_out}


def test_the_export_dialog_says_only_what_is_so_and_fits_its_instructions(
    qtbot: Any, window: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.export.install import LMSTUDIO_URL_VARIABLE

    home = tmp_path / "no-lm-studio"  # a machine without LM Studio, its server not running either
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv(LMSTUDIO_URL_VARIABLE, "http://127.0.0.1:9")
    monkeypatch.setattr("shutil.which", lambda name, *args, **kwargs: None)
    run_demo(qtbot, window)
    window.run_panel.export_button.click()
    dialog = window.run_panel.export_dialog
    qtbot.waitExposed(dialog)
    dialog.kinds["merged"].setChecked(True)
    dialog.export_button.click()
    qtbot.waitUntil(lambda: dialog.result is not None and not dialog.busy(), timeout=HANG_MS)
    assert "merged" in dialog.status.text()
    dialog.kinds["gguf"].setChecked(True)
    assert "Exported to" not in dialog.status.text() and not dialog.open_button.isEnabled()
    dialog.export_button.click()
    qtbot.waitUntil(lambda: dialog.result is not None and not dialog.busy(), timeout=HANG_MS)
    assert dialog.error.text() == "" and "gguf" in dialog.status.text()
    qtbot.waitUntil(lambda: "France" not in dialog.install.question.text() and not dialog.busy())
    assert dialog.install.question.text() in held_out_questions(window.run_panel.ended_run)
    dialog.install.buttons["lmstudio"].click()
    qtbot.waitUntil(lambda: dialog.install.report is not None and not dialog.busy(), timeout=HANG_MS)
    said = dialog.install.status.text()
    assert "not installed" in said and "lmstudio.ai" in said, said
    assert not (home / ".lmstudio").exists() and not (home / ".cache").exists(), "LM Studio's folder made for nothing"
    scroll = dialog.findChild(QScrollArea)
    for size in (QSize(640, 700), dialog.minimumSizeHint()):
        dialog.resize(size)
        qtbot.wait(50)  # layouts settle on the next passes of the event loop
        assert cut_off(dialog, scroll) == [], f"at {size.toTuple()}: {cut_off(dialog, scroll)}"


def test_words_before_a_run_are_so_on_a_machine_without_a_gpu(qtbot: Any, window: Any) -> None:
    prepare_demo(qtbot, window, max_steps=3)
    status = window.run_panel.status.text()
    assert window.guide.missing() == [] and status.startswith("Ready") and "choose" not in status, status
    if window.state.hardware.gpus:
        pytest.skip("this machine has a GPU: its words may name it")
    said = []
    for title in window.page_titles():
        window.show_page(title)
        page = window.pages.currentWidget()
        said += [label.text() for label in page.findChildren(QLabel)]
        said += [widget.toolTip() for widget in page.findChildren(QWidget)]
    wrong = [text for text in said if any(word in text for word in ("this GPU", "this card", "GPU class"))]
    assert wrong == []


def indicator_contrast(button: QAbstractButton, ground: str) -> tuple[float, float]:
    """(the indicator's most visible pixel against the window's colour ``ground``, the most visible pixel inside
    it against its own fill), from the drawn button: a ring that reads, and a dot or tick that reads."""
    from PySide6.QtGui import QColor
    from PySide6.QtWidgets import QRadioButton, QStyle

    from app.theme import contrast_ratio

    metric = QStyle.PixelMetric
    radio = isinstance(button, QRadioButton)
    size = button.style().pixelMetric(metric.PM_ExclusiveIndicatorWidth if radio else metric.PM_IndicatorWidth)
    image = button.grab().toImage()
    top = (button.height() - size) // 2
    pixels = [QColor(image.pixel(x, y)).name() for x in range(size) for y in range(top, top + size)]
    fill = QColor(image.pixel(3, top + size // 2)).name()  # just inside the ring
    inner = [QColor(image.pixel(x, y)).name() for x in range(4, size - 4) for y in range(top + 4, top + size - 4)]
    return max(contrast_ratio(pixel, ground) for pixel in pixels), max(contrast_ratio(p, fill) for p in inner)


def test_radio_buttons_and_check_boxes_read_in_the_dark_look(qtbot: Any, window: Any) -> None:
    from PySide6.QtGui import QPalette
    from PySide6.QtWidgets import QCheckBox

    window.resize(LAPTOP)
    window.show_page("Recipe")
    panel = window.setup_panel
    qtbot.waitExposed(window)
    checked = next(button for button in panel.buttons.values() if button.isChecked())
    unchecked = next(button for button in panel.buttons.values() if not button.isChecked())
    box = next(box for box in panel.findChildren(QCheckBox) if box.isVisible())
    box.setChecked(True)
    buttons = (checked, unchecked, box)
    try:
        for dark in (True, False):
            window.set_look(dark)
            look = "dark" if dark else "light"
            for widget in (window, *buttons):  # the new palette reaches the widgets through the event loop
                qtbot.waitUntil(
                    lambda w=widget, d=dark: (w.palette().color(QPalette.ColorRole.Base).lightness() < 128) == d
                )
            ground = window.palette().color(QPalette.ColorRole.Window)
            for button in buttons:
                ring, mark = indicator_contrast(button, ground.name())
                assert ring >= 3.0, f"{button.text()!r}'s indicator against the window in the {look} look: {ring:.2f}"
                if button.isChecked():
                    assert mark >= 3.0, f"{button.text()!r}'s mark in the {look} look: {mark:.2f}"
    finally:
        window.set_look(False)


def test_a_resumed_run_marks_no_switch_change_when_none_was_flipped(qtbot: Any, window: Any) -> None:
    from engine.events import RunStarted, StepMetrics

    prepare_demo(qtbot, window, max_steps=200)
    steps: list[int] = []
    starts: list[RunStarted] = []
    window.controller.run_event.connect(lambda e: steps.append(e.step) if isinstance(e, StepMetrics) else None)
    window.controller.run_event.connect(lambda e: starts.append(e) if isinstance(e, RunStarted) else None)
    panel = window.run_panel
    panel.start_button.click()
    qtbot.waitUntil(lambda: len(steps) >= 2, timeout=HANG_MS)
    panel.stop_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.FINISHED, timeout=HANG_MS)
    stopped_at = steps[-1]
    panel.resume_run(starts[-1].run_dir)
    qtbot.waitUntil(lambda: len(starts) == 2 and steps[-1] > stopped_at + 1, timeout=HANG_MS)
    panel.stop_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.FINISHED, timeout=HANG_MS)
    assert panel.charts.marks == [], "no switch was flipped"
