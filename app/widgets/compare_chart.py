"""Compare's results as a picture: one horizontal bar per switch, its speed-up in percent, and the spread.

A bar right of zero means faster with the switch on; its whisker is the standard deviation over the rounds, so a
bar whose whisker crosses zero is within the noise. Switches that have nothing to do on this run get no bar, only
their name. Colours come from the palette (and follow the light or dark look).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtGui import QFontMetrics
from PySide6.QtWidgets import QWidget

from app.background.ab_compare import Measurement
from app.theme import ERROR_COLOR, current_chart_colors, style_plot
from app.widgets.page_chart import PageChart

FASTER_COLOR = "#2ca02c"
SLOWER_COLOR = ERROR_COLOR
BAR_HEIGHT = 0.6


class CompareChart(PageChart):
    """Speed-up per switch (mean ± spread over rounds) as bars with whiskers."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent, title="Speed-up with the switch on (mean ± spread over rounds)")
        self.setLabel("bottom", "% faster with the switch on than off")
        self.showGrid(x=True, y=False, alpha=0.2)
        self.setMouseEnabled(x=False, y=False)
        self.hideButtons()
        self.getPlotItem().getAxis("left").setStyle(tickLength=0)
        self.rows: list[tuple[str, Measurement]] = []
        self._drawn: list[Any] = []
        self.setMinimumHeight(160)
        self.show_results([])

    def show_results(self, rows: list[tuple[str, Measurement]]) -> None:
        """``rows`` are (label, measurement) in the order they are listed, top to bottom."""
        self.rows = list(rows)
        self._draw()

    def _draw(self) -> None:
        for item in self._drawn:
            self.removeItem(item)
        self._drawn = []
        colors = current_chart_colors()
        style_plot(self, colors)
        count = max(1, len(self.rows))
        ys = [count - 1 - index for index in range(len(self.rows))]  # the first row on top
        axis = self.getPlotItem().getAxis("left")
        axis.setTicks([[(y, label) for y, (label, _) in zip(ys, self.rows, strict=True)]])
        widest = max((QFontMetrics(axis.font()).horizontalAdvance(label) for label, _ in self.rows), default=0)
        axis.setWidth(widest + 16)  # before the first paint: pyqtgraph would only widen the axis after it
        measured = [(y, m) for y, (_, m) in zip(ys, self.rows, strict=True) if m.percent is not None]
        zero = pg.InfiniteLine(pos=0, angle=90, pen=pg.mkPen(colors.foreground, width=1))
        self._add(zero)
        for y, measurement in measured:
            self._add_bar(y, measurement, colors.foreground)
        for y, (_, measurement) in zip(ys, self.rows, strict=True):
            if measurement.percent is None:
                self._add_text(0, y, measurement.short(), colors.foreground, anchor=(0, 0.5))
        self._fit_x([m for _, m in measured])
        self.setYRange(-0.6, count - 0.4, padding=0)

    def _fit_x(self, measured: list[Measurement]) -> None:
        """Every bar and whisker in view, with room for the labels beyond their ends."""
        low = min([0.0, *((m.percent or 0) - m.spread * 100 for m in measured)])
        high = max([0.0, *((m.percent or 0) + m.spread * 100 for m in measured)])
        span = max(high - low, 5.0)
        left_labels = any((m.percent or 0) < 0 for m in measured)
        self.setXRange(low - span * (0.35 if left_labels else 0.05), high + span * 0.35, padding=0)

    def _add_bar(self, y: float, measurement: Measurement, text_color: str) -> None:
        percent = measurement.percent or 0.0
        spread = measurement.spread * 100 if measurement.in_full else 0.0  # a cut-short run: no spread to show
        color = FASTER_COLOR if percent >= 0 else SLOWER_COLOR
        bar = pg.BarGraphItem(x0=[min(0.0, percent)], y=[y], width=[abs(percent)], height=BAR_HEIGHT, brush=color,
                              pen=pg.mkPen(color))  # fmt: skip
        self._add(bar)
        if spread > 0:
            whisker = pg.ErrorBarItem(x=np.array([percent]), y=np.array([y]), left=spread, right=spread,
                                      beam=BAR_HEIGHT / 2, pen=pg.mkPen(text_color, width=1.5))  # fmt: skip
            self._add(whisker)
        end = percent + spread if percent >= 0 else percent - spread
        self._add_text(end, y, f"  {measurement.short()}  ", text_color, anchor=(0, 0.5) if percent >= 0 else (1, 0.5))

    def _add_text(self, x: float, y: float, text: str, color: str, anchor: tuple[float, float]) -> None:
        label = pg.TextItem(text, color=color, anchor=anchor)
        label.setPos(x, y)
        self._add(label)

    def _add(self, item: Any) -> None:
        self.addItem(item)
        self._drawn.append(item)

    def restyle(self) -> None:
        """Redraw in the application's current colours (the window calls this when the look changes)."""
        self._draw()
