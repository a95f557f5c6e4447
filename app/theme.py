"""A light and a dark look that follow the system, and charts coloured from the window's palette.

Qt 6.5+ reports the system's colour scheme (``QStyleHints.colorScheme()``) and signals when it changes; the
window applies Fusion with a palette for that scheme, then recolours every pyqtgraph chart from the palette
(pyqtgraph draws its own background and axes and does not follow Qt's palette by itself). An unknown scheme
(a desktop that does not say) gets the light look.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QStyleFactory, QWidget

ERROR_COLOR = "#e0484d"
"""Errors and warnings: a red that reads on the light and the dark background alike."""

DARK_COLORS = {
    QPalette.ColorRole.Window: "#26282b",
    QPalette.ColorRole.WindowText: "#e6e6e6",
    QPalette.ColorRole.Base: "#1d1f21",
    QPalette.ColorRole.AlternateBase: "#2c2f33",
    QPalette.ColorRole.ToolTipBase: "#33363a",
    QPalette.ColorRole.ToolTipText: "#e6e6e6",
    QPalette.ColorRole.PlaceholderText: "#8d9096",
    QPalette.ColorRole.Text: "#e6e6e6",
    QPalette.ColorRole.Button: "#33363a",
    QPalette.ColorRole.ButtonText: "#e6e6e6",
    QPalette.ColorRole.BrightText: "#ff6b6b",
    QPalette.ColorRole.Light: "#45494e",
    QPalette.ColorRole.Midlight: "#3a3d42",
    QPalette.ColorRole.Mid: "#2f3236",
    QPalette.ColorRole.Dark: "#17181a",
    QPalette.ColorRole.Shadow: "#0d0d0e",
    QPalette.ColorRole.Highlight: "#3d7bd9",
    QPalette.ColorRole.HighlightedText: "#ffffff",
    QPalette.ColorRole.Link: "#6aa6ff",
    QPalette.ColorRole.LinkVisited: "#b08cff",
}
DARK_INDICATOR_RING = "#c4c7cc"
"""Fusion darkens the window colour for an indicator's ring: from this grey, a ring of 3:1 or more on the dark look."""
LIGHT_INDICATOR_RING = "#b4b4b4"
"""The same for the light look, whose own ring (2.1:1 against the window) was faint too."""
DARK_INDICATOR_MARK = "#f2f2f2"
"""A radio button's dot and a check box's tick in the dark look."""
INDICATOR_CLASSES = ("QRadioButton", "QCheckBox")
DISABLED_DARK = {
    QPalette.ColorRole.WindowText: "#7c7f84",
    QPalette.ColorRole.Text: "#7c7f84",
    QPalette.ColorRole.ButtonText: "#7c7f84",
    QPalette.ColorRole.Button: "#2b2d30",
    QPalette.ColorRole.Base: "#222426",
}


@dataclass(frozen=True)
class ChartColors:
    """What a chart needs from the palette: its background, axes and text, and the grid's strength."""

    background: str
    foreground: str
    accent: str


def system_is_dark() -> bool:
    """True when the system asks for a dark look (Qt 6.5+); False for light or unknown."""
    hints = QGuiApplication.styleHints()
    return hints is not None and hints.colorScheme() == Qt.ColorScheme.Dark


def palette_for(dark: bool) -> QPalette:
    """Fusion's own light palette, or a dark one with readable disabled text."""
    style = QStyleFactory.create("Fusion")
    palette = QPalette(style.standardPalette())
    if not dark:
        return palette
    for role, color in DARK_COLORS.items():
        palette.setColor(role, QColor(color))
    for role, color in DISABLED_DARK.items():
        palette.setColor(QPalette.ColorGroup.Disabled, role, QColor(color))
    return palette


def indicator_palette(dark: bool) -> QPalette:
    """The palette of radio buttons and check boxes: the look's own, with a ring and a mark that read.

    Fusion draws an indicator's ring in the window colour darkened and fills it with the base colour: on the dark
    palette that is near-black on dark grey (1.2:1), and a user could not see the recipes' radio buttons at all
    (the light look's was 2.1:1). Fusion fills no background behind these buttons, so their window colour is only
    the ring's: a grey from which the ring is 3:1 or more against the window in both looks.
    """
    palette = palette_for(dark)
    palette.setColor(QPalette.ColorRole.Window, QColor(DARK_INDICATOR_RING if dark else LIGHT_INDICATOR_RING))
    if dark:
        palette.setColor(QPalette.ColorRole.Text, QColor(DARK_INDICATOR_MARK))
    return palette


def chart_colors(palette: QPalette) -> ChartColors:
    return ChartColors(
        background=palette.color(QPalette.ColorRole.Base).name(),
        foreground=palette.color(QPalette.ColorRole.Text).name(),
        accent=palette.color(QPalette.ColorRole.Highlight).name(),
    )


def contrast_ratio(first: str, second: str) -> float:
    """WCAG contrast ratio of two colours (1 to 21); 3 or more reads as a distinct shape beside the other."""

    def luminance(name: str) -> float:
        color = QColor(name)
        channels = [c / 255 for c in (color.red(), color.green(), color.blue())]
        linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    light, dark = sorted((luminance(first), luminance(second)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def current_chart_colors() -> ChartColors:
    """The colours charts take now (the application's palette; Fusion light before any window exists)."""
    app = QApplication.instance()
    palette = app.palette() if isinstance(app, QApplication) else palette_for(dark=False)
    return chart_colors(palette)


def apply_look(dark: bool) -> None:
    """Fusion with the light or dark palette for the whole application; new charts take its colours."""
    app = QApplication.instance()
    if not isinstance(app, QApplication):
        return
    app.setStyle("Fusion")
    app.setPalette(palette_for(dark))
    for name in INDICATOR_CLASSES:  # a palette for these classes alone: no Python runs while they paint
        app.setPalette(indicator_palette(dark), name)  # type: ignore[arg-type]  # PySide6 takes the class name as str
    colors = current_chart_colors()
    pg.setConfigOptions(background=colors.background, foreground=colors.foreground)


def style_plot(plot: pg.PlotWidget, colors: ChartColors) -> None:
    """Recolour one chart: background, axes, tick labels, title and legend text."""
    plot.setBackground(colors.background)
    item = plot.getPlotItem()
    for name in ("left", "bottom", "right", "top"):
        axis = item.getAxis(name)
        axis.setPen(colors.foreground)
        axis.setTextPen(colors.foreground)
    title = item.titleLabel
    if title.text:
        title.setText(title.text, color=colors.foreground)
    legend = item.legend
    if legend is not None:
        legend.setLabelTextColor(colors.foreground)
        for _, label in legend.items:
            label.setText(label.text, color=colors.foreground)


def style_plots(widgets: Iterable[QWidget]) -> None:
    """Recolour every chart inside ``widgets`` from the application's palette."""
    colors = current_chart_colors()
    for widget in widgets:
        for plot in widget.findChildren(pg.PlotWidget):
            restyle = getattr(plot, "restyle", None)  # a chart with coloured items of its own redraws them
            if callable(restyle):
                restyle()
            else:
                style_plot(plot, colors)
