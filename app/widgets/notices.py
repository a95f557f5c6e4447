"""The run's warnings and notices: the newest on top, and nothing said twice.

A run saves a checkpoint every few steps and telemetry repeats the same warning while a condition lasts; a list
of every occurrence buries what matters. Messages with a ``key`` replace the previous one of that key in place
(the last checkpoint, not a list of them); a message already shown is counted ("×3") instead of added again.
"""

from __future__ import annotations

from PySide6.QtGui import QColor
from PySide6.QtWidgets import QListWidget, QListWidgetItem

from app.theme import ERROR_COLOR

COUNT_ROLE = 0x0101
KEY_ROLE = 0x0102
TEXT_ROLE = 0x0103


class NoticeList(QListWidget):
    """A short list of distinct notices; ``add`` collapses repeats."""

    def add(self, message: str, *, key: str | None = None, warning: bool = False) -> QListWidgetItem:
        """Show ``message`` on top: in place of the last message with ``key``, or counted if already shown."""
        item = self._find(key, message)
        if item is None:
            item = QListWidgetItem()
            item.setData(COUNT_ROLE, 0)
            item.setData(KEY_ROLE, key)
        else:
            self.takeItem(self.row(item))
        count = 1 if key is not None else int(item.data(COUNT_ROLE)) + 1
        item.setData(COUNT_ROLE, count)
        item.setData(TEXT_ROLE, message)
        prefix = "⚠ " if warning else ""
        item.setText(prefix + message + (f"  (×{count})" if count > 1 else ""))
        if warning:
            item.setForeground(QColor(ERROR_COLOR))
        self.insertItem(0, item)  # newest on top, where the user looks
        return item

    def messages(self) -> list[str]:
        """The notices as shown, newest first."""
        return [self.item(row).text() for row in range(self.count())]

    def _find(self, key: str | None, message: str) -> QListWidgetItem | None:
        for row in range(self.count()):
            item = self.item(row)
            if (key is not None and item.data(KEY_ROLE) == key) or (key is None and item.data(TEXT_ROLE) == message):
                return item
        return None
