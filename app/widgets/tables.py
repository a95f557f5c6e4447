"""The app's read-only tables: whole rows selected, no cell edited in place, no row numbers."""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtWidgets import QAbstractItemView, QTableWidget


def read_only_table(columns: Sequence[str], *, several: bool = False) -> QTableWidget:
    """An empty table with ``columns``; a click selects a whole row, and ``several`` lets shift/ctrl add more."""
    table = QTableWidget(0, len(columns))
    table.setHorizontalHeaderLabels(list(columns))
    table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
    mode = QAbstractItemView.SelectionMode
    table.setSelectionMode(mode.ExtendedSelection if several else mode.SingleSelection)
    table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
    table.verticalHeader().setVisible(False)
    return table
