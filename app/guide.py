"""The guide bar above every page: Model → Data → Recipe → Start, each step saying what it has or what is missing.

Each step is a button that opens its page; its second line comes from the page's ``step_status()`` (ready, text)
and updates when the page emits ``changed``. Start is enabled once every step is ready and no run is going; the
line beside it says what to do next. The demo is chosen once the machine is detected, with its dataset and recipe,
so Start is the only click it needs; choosing it again is Model → "Use this model" → Start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QSizePolicy

READY_COLOUR = "#2f9a4e"  # mid-tones: they read on the light and the dark look
MISSING_COLOUR = "#b7791f"
MAX_STEP_TEXT = 52
STEP_STYLE = "QPushButton {{ text-align: left; padding: 2px 10px; color: {colour}; }}"


class GuidedPage(Protocol):
    changed: Any

    def step_status(self) -> tuple[bool, str]: ...


def shorten(text: str, limit: int = MAX_STEP_TEXT) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


class GuideBar(QFrame):
    """Step buttons for the guided path and the Start button."""

    page_requested = Signal(str)
    start_clicked = Signal()

    def __init__(self, steps: Sequence[tuple[str, str, GuidedPage]], controller: Any) -> None:
        """``steps``: (step name, page title, page); ``controller``: the run controller (active, state_changed)."""
        super().__init__()
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.steps = list(steps)
        self.controller = controller
        self.buttons: list[QPushButton] = []
        self.start_button = QPushButton("▶  Start")
        self.start_button.setMinimumHeight(44)
        self.start_button.setStyleSheet("QPushButton { font-size: 15px; font-weight: bold; padding: 0 18px; }")
        self.start_button.clicked.connect(self.start_clicked)
        self.next = QLabel("")
        self.next.setWordWrap(True)
        self.next.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        for number, (name, title, page) in enumerate(self.steps, start=1):
            button = QPushButton()
            button.setMinimumSize(150, 44)  # narrower windows clip the status line; its tooltip keeps it whole
            button.clicked.connect(lambda _=False, title=title: self.page_requested.emit(title))
            button.setProperty("step", f"{number}  {name}")
            page.changed.connect(self.refresh)
            self.buttons.append(button)
            layout.addWidget(button)
            layout.addWidget(QLabel("→"))
        layout.addWidget(self.start_button)
        layout.addWidget(self.next, 1)
        controller.state_changed.connect(lambda _state: self.refresh())
        self.refresh()
        # A fixed height: text changing here during a run must never re-lay out the pages (and charts) below.
        self.setFixedHeight(self.sizeHint().height())

    def missing(self) -> list[tuple[str, str]]:
        """(page title, what is missing) of every step that is not ready, in order."""
        return [(title, text) for _, title, page in self.steps for ready, text in [page.step_status()] if not ready]

    def refresh(self) -> None:
        for button, (_, _, page) in zip(self.buttons, self.steps, strict=True):
            ready, text = page.step_status()
            mark = "✓" if ready else "•"
            button.setText(f"{mark} {button.property('step')}\n{shorten(text)}")
            button.setToolTip(text)
            style = STEP_STYLE.format(colour=READY_COLOUR if ready else MISSING_COLOUR)
            if button.styleSheet() != style:  # re-polishing on every refresh would cost a repaint each time
                button.setStyleSheet(style)
        missing = self.missing()
        running = bool(self.controller.active)
        self.start_button.setEnabled(not missing and not running)
        if running:
            self.next.setText("A run is going: watch it on the Run page.")
        elif missing:
            self.next.setText(f"Next: {missing[0][1]}")
        else:
            self.next.setText("Ready: Start begins the run, and the Run page follows it.")
