"""Readable in both looks and on a laptop screen: the Dataset page's histogram takes the palette's colours, and the
guide bar's texts fit their widgets at 1366x768 and name the machine the run trains on."""

from __future__ import annotations

from typing import Any

from app_demo import LOAD_TIMEOUT_MS
from PySide6.QtCore import QPointF, QRect, QSize, Qt
from PySide6.QtGui import QColor, QFontMetrics

pytest_plugins = ["app_fixtures"]

LAPTOP = QSize(1366, 768)
LENGTHS = [37, 38, 38, 39, 40, 40, 40, 41, 44, 46, 46, 46, 47, 52, 53]


def cpu_machine() -> Any:
    from engine.hardware.detect import HardwareInfo

    return HardwareInfo((), None, None, "2.13.0", None, "Linux", False, 2, 24 << 30)


def pixel(image: Any, point: QPointF) -> str:
    return QColor(image.pixel(round(point.x()), round(point.y()))).name()


def histogram_contrasts(histogram: Any) -> tuple[float, float]:
    """(bar against background, tick text against background), read from the drawn chart."""
    import pyqtgraph as pg

    from app.theme import contrast_ratio

    image = histogram.grab().toImage()
    scale = image.width() / histogram.width()
    item = histogram.getPlotItem()
    bars = next(bar for bar in item.items if isinstance(bar, pg.BarGraphItem)).opts
    tallest = int(max(range(len(bars["height"])), key=lambda i: bars["height"][i]))
    middle = (bars["x0"][tallest] + bars["x1"][tallest]) / 2
    to_widget = lambda x, y: histogram.mapFromScene(item.vb.mapViewToScene(QPointF(x, y)))  # noqa: E731
    inside = to_widget(middle, bars["height"][tallest] / 2)
    above = to_widget(middle, bars["height"][tallest] * 1.02)  # the ground just above the tallest bar
    bar, ground = pixel(image, inside * scale), pixel(image, above * scale)
    return contrast_ratio(bar, ground), contrast_ratio(item.getAxis("left").textPen().color().name(), ground)


def assert_readable(histogram: Any, look: str) -> None:
    bar, text = histogram_contrasts(histogram)
    assert bar >= 3.0, f"bars against the ground in the {look} look: {bar:.2f}"
    assert text >= 4.5, f"tick labels against the ground in the {look} look: {text:.2f}"


def load_demo_data(qtbot: Any, win: Any) -> Any:
    from app.pages.data import demo_data_file

    win.resize(LAPTOP)
    win.show_page("Dataset")
    win.data_panel.load(str(demo_data_file()))
    qtbot.waitUntil(lambda: win.state.data_report is not None, timeout=LOAD_TIMEOUT_MS)
    qtbot.waitExposed(win)
    return win.data_panel.histogram


def test_the_length_histogram_reads_after_switching_between_the_looks(qtbot: Any, window: Any) -> None:
    histogram = load_demo_data(qtbot, window)
    try:
        for dark in (False, True, False, True):
            window.set_look(dark)
            assert_readable(histogram, "dark" if dark else "light")
    finally:
        window.set_look(False)


def test_the_length_histogram_reads_when_the_window_opens_in_the_dark_look(
    qtbot: Any, tmp_path: Any, monkeypatch: Any
) -> None:
    """A system in the dark look: the page's chart is built under the dark palette and must take it."""
    from PySide6.QtCore import QSettings

    import app.main_window as main_window

    monkeypatch.setenv("TUNEDECK_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(main_window, "system_is_dark", lambda: True)
    win = main_window.MainWindow(detect_on_show=False, settings=QSettings(str(tmp_path / "w.ini"),
                                                                          QSettings.Format.IniFormat))  # fmt: skip
    qtbot.addWidget(win)
    win.show()
    try:
        assert_readable(load_demo_data(qtbot, win), "dark")
    finally:
        win.set_look(False)
        win.close()


class StubPage:
    """A guided page whose status a test sets: the guide bar only reads ``step_status`` and ``changed``."""

    def __init__(self, status: tuple[bool, str]) -> None:
        from PySide6.QtCore import QObject, Signal

        class Emitter(QObject):
            changed = Signal()

        self.emitter = Emitter()
        self.changed = self.emitter.changed
        self.status = status

    def step_status(self) -> tuple[bool, str]:
        return self.status


def fits(label_text: str, metrics: QFontMetrics, width: int, height: int) -> bool:
    used = metrics.boundingRect(QRect(0, 0, width, 1 << 16), int(Qt.TextFlag.TextWordWrap), label_text)
    return used.width() <= width and used.height() <= height


def test_the_guide_names_this_computers_cpu_and_every_text_fits_at_1366(qtbot: Any, window: Any) -> None:
    """On a machine without a GPU, a model too big for it: the guide says CPU, never GPU, and nothing is clipped."""
    from engine.hardware.profile import build_profile
    from engine.hardware.shapes import load_shape
    from engine.model.info import ModelInfo, verdict_of

    window.resize(LAPTOP)
    machine = cpu_machine()
    shape = load_shape("llama-3.1-8b")
    profile = build_profile(machine, shape)
    verdict, reason = verdict_of(profile)
    assert verdict == "too big"
    window.state.set_hardware(machine, None)
    window.state.set_model("llama-3.1-8b", ModelInfo("llama-3.1-8b", "llama", 8_000_000_000, False, verdict, reason,
                                                     shape=shape, profile=profile))  # fmt: skip
    window.setup_panel.check_fit()
    guide = window.guide
    qtbot.waitUntil(lambda: "Choose a smaller model" in guide.next.text(), timeout=LOAD_TIMEOUT_MS)
    assert guide.width() <= LAPTOP.width() and window.width() == LAPTOP.width(), "the bar fits the laptop screen"
    texts = [button.toolTip() for button in guide.buttons] + [guide.next.toolTip(), guide.next.text()]
    assert "will not fit on this computer's CPU" in guide.buttons[2].toolTip(), guide.buttons[2].toolTip()
    assert not [text for text in texts if "GPU" in text], texts
    for button in guide.buttons:
        _name, status = button.text().split("\n")
        metrics = button.fontMetrics()
        assert metrics.horizontalAdvance(status) <= button.width() - 2 * 10, f"{status!r} overflows {button.width()}"
        assert status == button.toolTip() or status.endswith("…"), "a cut status says that it is cut"
    next_label = guide.next
    assert fits(next_label.text(), next_label.fontMetrics(), next_label.contentsRect().width(),
                next_label.contentsRect().height()), f"{next_label.text()!r} is clipped"  # fmt: skip
    assert next_label.toolTip().startswith("Next: Choose a smaller model: llama-3.1-8b is too big")


def test_the_ready_line_says_the_run_trains_on_this_computers_cpu(qtbot: Any) -> None:
    from PySide6.QtCore import QObject, Signal

    from app.app_state import AppState
    from app.widgets.guide import GuideBar
    from engine.hardware import gpus
    from engine.hardware.profile import DeviceTarget

    class Controller(QObject):
        state_changed = Signal(str)
        active = False

    state, controller = AppState(), Controller()
    pages = [StubPage((True, text)) for text in ("demo: fits", "train.jsonl: 2,000 examples", "Demo recipe")]
    guide = GuideBar([(name, name, page) for name, page in zip(("Model", "Data", "Recipe"), pages, strict=True)],
                     controller, state)  # fmt: skip
    qtbot.addWidget(guide)
    state.set_hardware(cpu_machine(), None)
    assert guide.start_button.isEnabled()
    assert guide.next.whole == "Ready: Start trains on this computer's CPU; the Run page follows it."
    state.set_hardware(DeviceTarget.from_spec(gpus.find_gpu("RTX 4090")), None)
    assert guide.next.whole == "Ready: Start trains on the RTX 4090; the Run page follows it."


def test_the_guides_step_texts_read_in_the_light_and_the_dark_look(qtbot: Any, window: Any) -> None:
    """Each step's coloured text against its button as drawn, in both looks (4.5:1, the rule for text)."""
    import re

    from PySide6.QtWidgets import QApplication

    from app.theme import contrast_ratio

    window.resize(LAPTOP)
    qtbot.waitExposed(window)
    try:
        for dark in (False, True, False):
            window.set_look(dark)
            QApplication.processEvents()  # the new palette reaches the widgets through posted events
            for button in window.guide.buttons:
                image = button.grab().toImage()
                ground = QColor(image.pixel(image.width() - 8, image.height() // 2)).name()
                colour = re.search(r"color: (#[0-9a-f]{6})", button.styleSheet())
                assert colour is not None, button.styleSheet()
                ratio = contrast_ratio(colour.group(1), ground)
                look = "dark" if dark else "light"
                assert ratio >= 4.5, f"{button.name}, {look}: {colour.group(1)} on {ground}: {ratio:.2f}"
    finally:
        window.set_look(False)
