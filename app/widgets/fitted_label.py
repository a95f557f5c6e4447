"""A word-wrapped line whose height follows its text: as many lines as the text needs at the label's width.

The Run page's status lines change every step; a label that asks the layout for a new height on every change
re-lays out the charts below it, and repainting them all at once blocked the window for over 100 ms on a busy
two-core machine. This label asks only when the number of lines changes (a path wraps, a message ends), so a
narrow window shows the whole text instead of its first two lines.
"""

from __future__ import annotations

from PySide6.QtGui import QResizeEvent
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget


class FittedLabel(QLabel):
    """A word-wrapped label as high as its text at its width, and at least ``lines`` lines high (an empty one keeps
    its place; with 0 it takes none)."""

    def __init__(self, text: str = "", lines: int = 1, parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        self.lines = lines
        self.setWordWrap(True)
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)  # never widens the page
        self._fit()

    def setText(self, text: str) -> None:
        if text != self.text():
            super().setText(text)
            self._fit()

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        if event.size().width() != event.oldSize().width():
            self._fit()

    def _fit(self) -> None:
        least = self.fontMetrics().lineSpacing() * self.lines + 6 if self.lines else 0
        height = max(least, self.heightForWidth(self.width()) if self.text() else 0)
        if self.minimumHeight() != height or self.maximumHeight() != height:
            self.setFixedHeight(height)
