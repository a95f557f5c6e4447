"""A run's before/after report as a picture: one group of bars per figure, one bar per model (before and tuned).

The figures have different units (a loss near 2, a perplexity in the thousands, a share of answers), so each group
is drawn against its own largest value and every bar carries its figure as text: the bars compare the models within
a figure, the text gives the value. Each figure's name says which way is better. Colours come from the palette for
text and axes (and follow the light or dark look); the models keep one colour each. A figure where guessing scores
something (a DPO run's share of held-out pairs preferred: chance is 50%) carries a dashed line at chance.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QFontMetrics
from PySide6.QtWidgets import QWidget

from app.theme import current_chart_colors, style_plot
from app.widgets.page_chart import PageChart

if TYPE_CHECKING:
    from engine.run.report import RunReport

MODEL_COLORS = ("#8c8c8c", "#2ca02c", "#1f77b4", "#ff7f0e")
"""The model before the run grey (the base model, or a DPO run's starting adapter), then the adapters (best, last)."""
TITLE = "Before and after, side by side (each figure against its largest)"
GROUP_HEIGHT = 0.8
DASH = Qt.PenStyle.DashLine
TEXT_ROOM = 0.45
"""Room right of the longest bar (a share of it) for its figure's text."""


@dataclass(frozen=True)
class Figure:
    """One group of bars: a figure of the report for every model (None where a model has none)."""

    name: str
    values: tuple[float | None, ...]
    spec: str
    """How its values are written: a format spec (".3f", ".0%")."""
    chance: float | None = None
    """What guessing scores (a DPO run's pairs preferred: 50%), marked across the group; None: no such mark."""

    def text(self, value: float | None) -> str:
        return "-" if value is None else format(value, self.spec)


def report_figures(report: RunReport) -> list[Figure]:
    """The report's figures, top to bottom, as the report lists them (engine.run.report.measures), each name saying
    which way is better and, where guessing scores something, what chance is. Figures no model has are left out."""
    figures = []
    for measure in report.measures():
        better = f"{measure.better} is better"
        if measure.chance is not None:
            better += f"; chance is {measure.chance:.0%}"
        values = tuple(measure.value(m) for m in report.models)
        figures.append(Figure(f"{measure.short_name} ({better})", values, measure.short, measure.chance))
    return [figure for figure in figures if any(value is not None for value in figure.values)]


class ReportChart(PageChart):
    """Base and tuned side by side, one group of horizontal bars per figure."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent, title=TITLE)
        self.setMouseEnabled(x=False, y=False)
        self.hideButtons()
        self.getPlotItem().hideAxis("bottom")
        self.getPlotItem().getAxis("left").setStyle(tickLength=0)
        self.figures: list[Figure] = []
        self.labels: list[str] = []
        self._drawn: list[Any] = []
        self.setMinimumHeight(260)

    def show_report(self, report: RunReport | None) -> None:
        """Draw ``report`` (None: an empty chart)."""
        self.figures = report_figures(report) if report is not None else []
        self.labels = [m.label for m in report.models] if report is not None else []
        self._draw()

    def bar_texts(self) -> list[list[str]]:
        """What each bar says, per figure (what a user reads beside the bars)."""
        return [[figure.text(value) for value in figure.values] for figure in self.figures]

    def _draw(self) -> None:
        for item in self._drawn:
            self.removeItem(item)
        self._drawn = []
        colors = current_chart_colors()
        self.setTitle(self._title_with_key())  # the key in the title: a legend inside covered the bars' figures
        style_plot(self, colors)
        count = max(1, len(self.figures))
        centres = [count - 1 - index for index in range(len(self.figures))]  # the first figure on top
        axis = self.getPlotItem().getAxis("left")
        axis.setTicks([[(y, figure.name) for y, figure in zip(centres, self.figures, strict=True)]])
        widest = max((QFontMetrics(axis.font()).horizontalAdvance(f.name) for f in self.figures), default=0)
        axis.setWidth(widest + 16)
        for y, figure in zip(centres, self.figures, strict=True):
            self._draw_group(y, figure, colors.foreground)
        self.setXRange(0, 1 + TEXT_ROOM, padding=0)
        self.setYRange(-0.6, count - 0.4, padding=0)

    def _draw_group(self, centre: float, figure: Figure, text_color: str) -> None:
        values = figure.values
        largest = max((abs(v) for v in values if v is not None), default=0.0) or 1.0
        height = GROUP_HEIGHT / max(len(values), 1)
        top = centre + GROUP_HEIGHT / 2 - height / 2
        for index, value in enumerate(values):
            y, color = top - index * height, MODEL_COLORS[index % len(MODEL_COLORS)]
            length = 0.0 if value is None else abs(value) / largest
            bar = pg.BarGraphItem(x0=[0.0], y=[y], width=[length], height=height * 0.9, brush=color,
                                  pen=pg.mkPen(color))  # fmt: skip
            self._add(bar)
            label = pg.TextItem(f" {figure.text(value)}", color=text_color, anchor=(0, 0.5))
            label.setPos(length, y)
            self._add(label)
        if figure.chance is not None:  # a dashed line where guessing lands, across the group's bars
            x = figure.chance / largest
            half = GROUP_HEIGHT / 2
            line = pg.PlotDataItem([x, x], [centre - half, centre + half], pen=pg.mkPen(text_color, style=DASH))
            self._add(line)

    def _title_with_key(self) -> str:
        """The title, then a coloured square and the name of each model."""
        key = "&nbsp;&nbsp;".join(
            f"<span style='color:{MODEL_COLORS[i % len(MODEL_COLORS)]}'>■</span>&nbsp;{html.escape(label)}"
            for i, label in enumerate(self.labels)
        )
        return f"{TITLE}<br>{key}" if key else TITLE

    def _add(self, item: Any) -> None:
        self.addItem(item)
        self._drawn.append(item)

    def restyle(self) -> None:
        """Redraw in the application's current colours (the window calls this when the look changes)."""
        self._draw()
