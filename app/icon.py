"""The window icon, drawn at start-up: the same rounded dark tile with three rising green bars as the installers'
icon (packaging/build draws that one pixel by pixel), so the app needs no image files to find at run time."""

from __future__ import annotations

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QIcon, QLinearGradient, QPainter, QPixmap

BARS = ((0.22, 0.45), (0.43, 0.62), (0.64, 0.80))
"""(left edge, height) of each bar as fractions of the icon's size."""


def icon_pixmap(size: int) -> QPixmap:
    pixmap = QPixmap(size, size)
    pixmap.fill(Qt.GlobalColor.transparent)
    painter = QPainter(pixmap)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    tile = QLinearGradient(0, 0, 0, size)
    tile.setColorAt(0, QColor(40, 48, 64))
    tile.setColorAt(1, QColor(70, 78, 94))
    painter.setPen(Qt.PenStyle.NoPen)
    painter.setBrush(tile)
    painter.drawRoundedRect(QRectF(0, 0, size, size), size * 0.18, size * 0.18)
    for left, height in BARS:
        painter.setBrush(QColor(60, int(200 + 40 * (1 - (0.86 - height / 2))), 120))
        painter.drawRect(QRectF(left * size, (0.86 - height) * size, 0.14 * size, height * size))
    painter.end()
    return pixmap


def app_icon() -> QIcon:
    icon = QIcon()
    for size in (16, 32, 48, 64, 128, 256):
        icon.addPixmap(icon_pixmap(size))
    return icon
