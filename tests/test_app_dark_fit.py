"""In both looks, on a 1366x768 laptop screen and at the window's smallest size, the Chat page's adapter selector
and the Runs page's table show their whole text after a run."""

from __future__ import annotations

from typing import Any

import pytest
from PySide6.QtCore import QPoint, QSize
from PySide6.QtWidgets import QComboBox, QScrollArea
from test_app_day_of_use import LAPTOP, cut_off, run_demo

pytest_plugins = ["app_fixtures"]

ARROW_AND_MARGINS = 24
"""A combo box's drop-down arrow and frame beside its text, in pixels (at least)."""


def combo_cut(window: Any, page: Any, box: QComboBox) -> list[str]:
    """The adapter selector narrower than its words, or past the visible part of the page; and what ``cut_off``
    finds on the page."""
    scroll = window.pages.currentWidget().findChild(QScrollArea)
    problems = cut_off(page, scroll)
    if box.width() < box.fontMetrics().horizontalAdvance(box.currentText()) + ARROW_AND_MARGINS:
        problems.append(f"{box.currentText()!r} in a box {box.width()} wide")
    right = box.mapTo(scroll.viewport(), QPoint(box.width(), 0)).x()
    if right > scroll.viewport().width():
        problems.append(f"{box.currentText()!r} ends at {right}, past the page's {scroll.viewport().width()}")
    return problems


def cut_columns(table: Any) -> list[str]:
    """Columns narrower than their title or one of their cells."""
    header, metrics = table.horizontalHeader(), table.fontMetrics()
    cut = []
    for column in range(table.columnCount()):
        texts = [table.horizontalHeaderItem(column).text()]
        texts += [table.item(row, column).text() for row in range(table.rowCount()) if table.item(row, column)]
        needed = max(metrics.horizontalAdvance(text) for text in texts)
        if header.sectionSize(column) < needed:
            cut.append(f"{texts[0]!r} is {header.sectionSize(column)} wide, needs {needed}")
    return cut


def sizes(window: Any) -> list[QSize]:
    return [LAPTOP, window.minimumSizeHint()]


@pytest.mark.parametrize("dark", [False, True])
def test_the_adapter_selector_and_the_runs_table_show_their_whole_text(qtbot: Any, window: Any, dark: bool) -> None:
    window.set_look(dark)
    folder = run_demo(qtbot, window)
    chat, runs = window.page("Chat"), window.page("Runs")
    chat.runs.setCurrentIndex(chat.runs.findData(folder))
    assert chat.adapter.count() > 0
    runs.refresh()
    for size in sizes(window):
        window.resize(size)
        qtbot.waitUntil(lambda size=size: window.size() == size.expandedTo(window.minimumSizeHint()))
        checks = (("Chat", lambda: combo_cut(window, chat, chat.adapter)),
                  ("Runs", lambda: cut_columns(runs.table)))  # fmt: skip
        for title, check in checks:
            window.show_page(title)
            qtbot.wait(50)  # layouts settle on the next passes of the event loop
            assert not check(), f"{title} at {size.toTuple()}: {check()} ({chat.adapter.currentText()!r})"
