"""The guide bar above every page: Model → Data → Recipe → Start, each step saying what it has or what is missing.

Each step is a button that opens its page; its second line comes from the page's ``step_status()`` (ready, text)
and updates when the page emits ``changed``. Start is enabled once every step is ready and no run is going; the
line beside it says what to do next, and where the run trains (the GPU by name, or this computer's CPU). Every text
is cut to the room its widget has (the whole text in its tooltip), so a long reason never spills out of the bar on
a 1366-pixel-wide laptop screen. The demo is chosen once the machine is detected, with its dataset and recipe,
so Start is the only click it needs; choosing it again is Model → "Use this model" → Start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from PySide6.QtCore import QEvent, QRect, QSize, Qt, Signal
from PySide6.QtGui import QFontMetrics, QPalette, QResizeEvent
from PySide6.QtWidgets import QApplication, QFrame, QHBoxLayout, QLabel, QPushButton, QSizePolicy

from app.widgets.model_words import machine_name
from engine.run.summary import describe

STEP_COLOURS = {False: ("#1e7a3a", "#8a5a00"), True: ("#6fd08c", "#e8b04f")}
"""(ready, missing) text colours in the light and the dark look: 4.5:1 or more against the buttons (one mid-tone
green for both looks read at 3.4:1, too faint on the dark buttons)."""
STEP_WIDTH = (150, 260)
"""A step button's narrowest and widest: three of them, Start and the next line fit 1366 pixels."""
STEP_PADDING = 2 * 10 + 8
"""The style's left and right padding and the button's frame: what the text cannot use of the width."""
NEXT_LINES = 2
READY_TEXT = "Ready: model, dataset and recipe are chosen; Start runs them."
STEP_STYLE = "QPushButton {{ text-align: left; padding: 2px 10px; color: {colour}; }}"


class GuidedPage(Protocol):
    changed: Any

    def step_status(self) -> tuple[bool, str]: ...


def fit_text(text: str, metrics: QFontMetrics, width: int, lines: int = 1) -> str:
    """``text`` as it fits ``lines`` word-wrapped lines of ``width`` pixels: whole, or cut at the end with "…"."""

    def fits(candidate: str) -> bool:
        if lines == 1:
            return metrics.horizontalAdvance(candidate) <= width
        flags = int(Qt.TextFlag.TextWordWrap)
        used = metrics.boundingRect(QRect(0, 0, max(width, 1), 1 << 16), flags, candidate)
        return used.width() <= width and used.height() <= lines * metrics.lineSpacing()

    if fits(text):
        return text
    low, high = 0, len(text)  # the longest prefix that fits with its ellipsis
    while low < high:
        middle = (low + high + 1) // 2
        if fits(text[:middle].rstrip() + "…"):
            low = middle
        else:
            high = middle - 1
    return text[:low].rstrip() + "…"


def step_colours(palette: QPalette) -> tuple[str, str]:
    """(ready, missing) text colours for the look ``palette`` belongs to."""
    return STEP_COLOURS[palette.color(QPalette.ColorRole.Window).lightness() < 128]


class StepButton(QPushButton):
    """A step: its name over its status, the status cut to the button's width (whole in the tooltip)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.mark, self.status = name, "•", ""
        self.setMinimumSize(STEP_WIDTH[0], 44)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)

    def show_status(self, ready: bool, status: str) -> None:
        self.mark, self.status = ("✓" if ready else "•"), status
        self.setToolTip(status)
        self._fit()
        self.updateGeometry()

    def sizeHint(self) -> QSize:
        wanted = self.fontMetrics().horizontalAdvance(self.status) + STEP_PADDING
        return QSize(min(max(wanted, STEP_WIDTH[0]), STEP_WIDTH[1]), super().sizeHint().height())

    def minimumSizeHint(self) -> QSize:  # its status is cut to fit: the narrowest width always does
        return QSize(STEP_WIDTH[0], super().minimumSizeHint().height())

    def text_width(self) -> int:
        return self.width() - STEP_PADDING

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._fit()

    def _fit(self) -> None:
        status = fit_text(self.status, self.fontMetrics(), self.text_width())
        self.setText(f"{self.mark} {self.name}\n{status}")


class FittedLabel(QLabel):
    """A word-wrapped label whose text is cut to the lines it has room for (whole in the tooltip)."""

    def __init__(self, lines: int) -> None:
        super().__init__()
        self.lines, self.whole = lines, ""
        self.setWordWrap(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        self.setMinimumWidth(120)

    def show_text(self, text: str) -> None:
        self.whole = text
        self.setToolTip(text)
        self._fit()

    def minimumSizeHint(self) -> QSize:  # its text is cut to fit: it never asks for more room
        return QSize(self.minimumWidth(), self.fontMetrics().lineSpacing() * self.lines)

    def sizeHint(self) -> QSize:
        return self.minimumSizeHint()

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self._fit()

    def _fit(self) -> None:
        self.setText(fit_text(self.whole, self.fontMetrics(), self.contentsRect().width(), self.lines))


class GuideBar(QFrame):
    """Step buttons for the guided path and the Start button."""

    page_requested = Signal(str)
    start_clicked = Signal()
    ready_changed = Signal(str)
    """Before a run, what is missing or that all is ready (``ready_text``), each time it changes."""

    def __init__(self, steps: Sequence[tuple[str, str, GuidedPage]], controller: Any, state: Any = None) -> None:
        """``steps``: (step name, page title, page); ``controller``: the run controller (active, state_changed);
        ``state``: the app state, whose hardware names where the run trains."""
        super().__init__()
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.steps = list(steps)
        self.controller = controller
        self.state = state
        self.buttons: list[StepButton] = []
        self.ready_text = ""
        """What the next step is before a run (the Run page says the same); "" while a run goes."""
        self.start_button = QPushButton("▶  Start")
        self.start_button.setMinimumHeight(44)
        self.start_button.setStyleSheet("QPushButton { font-size: 15px; font-weight: bold; padding: 0 18px; }")
        self.start_button.clicked.connect(self.start_clicked)
        self.next = FittedLabel(NEXT_LINES)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        for number, (name, title, page) in enumerate(self.steps, start=1):
            button = StepButton(f"{number}  {name}")
            button.clicked.connect(lambda _=False, title=title: self.page_requested.emit(title))
            page.changed.connect(self.refresh)
            self.buttons.append(button)
            layout.addWidget(button)
            layout.addWidget(QLabel("→"))
        layout.addWidget(self.start_button)
        layout.addWidget(self.next, 1)
        controller.state_changed.connect(lambda _state: self.refresh())
        if state is not None:
            state.hardware_changed.connect(self.refresh)
            state.run_changed.connect(self.refresh)
        self.refresh()
        # A fixed height: text changing here during a run must never re-lay out the pages (and charts) below.
        self.setFixedHeight(self.sizeHint().height())

    def missing(self) -> list[tuple[str, str]]:
        """(page title, what is missing) of every step that is not ready, in order."""
        return [(title, text) for _, title, page in self.steps for ready, text in [page.step_status()] if not ready]

    def refresh(self) -> None:
        for button, (_, _, page) in zip(self.buttons, self.steps, strict=True):
            ready, text = page.step_status()
            button.show_status(ready, text)
            style = STEP_STYLE.format(colour=step_colours(QApplication.palette())[0 if ready else 1])
            if button.styleSheet() != style:  # re-polishing on every refresh would cost a repaint each time
                button.setStyleSheet(style)
        missing = self.missing()
        running = bool(self.controller.active)
        said = "" if running else f"Next: {missing[0][1]}" if missing else READY_TEXT
        if said != self.ready_text:
            self.ready_text = said
            self.ready_changed.emit(said)
        self.start_button.setEnabled(not missing and not running)
        if running:
            self.next.show_text(f"{self.run_line()}; watch it on the Run page.")
        elif missing:
            self.next.show_text(f"Next: {missing[0][1]}")
        else:
            self.next.show_text(f"Ready: Start trains on {self.machine()}; the Run page follows it.")

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() in (QEvent.Type.PaletteChange, QEvent.Type.ApplicationPaletteChange):  # light or dark look
            self.refresh()

    def run_line(self) -> str:
        """The run going on in the words every page uses: its state, progress, speed and measured peak."""
        run = getattr(self.state, "run", None)
        if run is None or run.state in ("idle", "loading"):
            return "A run is starting"
        texts = describe(run)
        parts = [texts.state.capitalize(), texts.progress, texts.speed,
                 f"peak memory measured: {texts.peak}" if texts.peak else ""]  # fmt: skip
        return " · ".join(part for part in parts if part)

    def machine(self) -> str:
        hardware = getattr(self.state, "hardware", None)
        return machine_name(hardware) if hardware is not None else "this computer"
