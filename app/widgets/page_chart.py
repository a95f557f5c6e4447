"""A chart inside a scrolling page: the mouse wheel scrolls the page, Ctrl+wheel zooms the chart.

pyqtgraph's charts take every wheel turn as a zoom, so a user scrolling down a page stopped on the first chart
under the pointer and zoomed it instead, and a chart zoomed by accident kept that range (a tokens/s chart sat at
-200,000 for every later run). The wheel goes to the page that holds the chart; Ctrl+wheel still zooms.
"""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QWheelEvent
from PySide6.QtWidgets import QAbstractScrollArea, QApplication, QWidget


class PageChart(pg.PlotWidget):
    """A pyqtgraph chart whose wheel scrolls the page around it (Ctrl+wheel zooms)."""

    def wheelEvent(self, event: QWheelEvent) -> None:
        if event.modifiers() & Qt.KeyboardModifier.ControlModifier:
            super().wheelEvent(event)
            return
        area = scrolling_ancestor(self)
        if area is None:
            event.ignore()
            return
        viewport = area.viewport()
        position = viewport.mapFromGlobal(event.globalPosition())
        forwarded = QWheelEvent(position, event.globalPosition(), event.pixelDelta(), event.angleDelta(),
                                event.buttons(), event.modifiers(), event.phase(), event.inverted())  # fmt: skip
        QApplication.sendEvent(viewport, forwarded)
        event.accept()


def scrolling_ancestor(widget: QWidget) -> QAbstractScrollArea | None:
    """The nearest scroll area that holds ``widget`` (not a chart: a chart is a scroll area too)."""
    parent = widget.parentWidget()
    while parent is not None:
        if isinstance(parent, QAbstractScrollArea) and not isinstance(parent, pg.PlotWidget):
            return parent
        parent = parent.parentWidget()
    return None
