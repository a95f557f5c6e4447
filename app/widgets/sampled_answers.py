"""A few answers the run just sampled and trained on, with each reward's score and the total.

Charts say whether the mean reward rises; reading the answers says why (the format learned, or a reward gamed by
an answer that repeats the prompt). Each new sampling replaces the table: one prompt's group, as the engine's
:class:`~engine.events.AnswersSampled` gives it, scored as the Recipe page's "Try" scores the base model's answers.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from PySide6.QtWidgets import QGroupBox, QHeaderView, QLabel, QTableWidgetItem, QVBoxLayout

from app.widgets.tables import read_only_table
from engine.events import AnswersSampled

WAITING = "The answers of the first sampling show here after the run's first step."


def score_headings(names: Sequence[str], weights: Sequence[float]) -> list[str]:
    """Each reward's column heading: its name, with its weight where that is not 1 ("length ×0.5")."""
    pairs = zip(names, [*weights, *[1.0] * (len(names) - len(weights))], strict=False)
    return [name if weight == 1 else f"{name} ×{weight:g}" for name, weight in pairs]


class SampledAnswers(QGroupBox):
    """The latest sampled answers to one prompt, with their scores."""

    def __init__(self) -> None:
        super().__init__("Sampled answers and their scores")
        self.weights: tuple[float, ...] = ()
        """The run's reward weights, in the order its rewards are built (for the headings)."""
        self.step = 0
        """The step the shown answers were trained on (0: none yet)."""
        self.prompt = QLabel(WAITING)
        self.prompt.setWordWrap(True)
        self.table = read_only_table(["Answer", "Total"])
        layout = QVBoxLayout(self)
        layout.addWidget(self.prompt)
        layout.addWidget(self.table, 1)

    def clear(self, weights: Sequence[float] = ()) -> None:
        """Nothing shown, for a new run whose rewards weigh ``weights``."""
        self.weights, self.step = tuple(weights), 0
        self.prompt.setText(WAITING)
        self.table.setRowCount(0)

    def show_answers(self, event: AnswersSampled) -> None:
        scores = event.scores or {}
        headings = score_headings(list(scores), self.weights)
        self.step = event.step
        self.prompt.setText(f"Step {event.step}, prompt: <i>{html.escape(_one_line(event.prompt))}</i>")
        self.prompt.setToolTip(event.prompt)
        table = self.table
        table.setColumnCount(2 + len(headings))
        table.setHorizontalHeaderLabels(["Answer", *headings, "Total"])
        table.setRowCount(len(event.answers))
        for row, answer in enumerate(event.answers):
            cells = [answer, *(f"{per[row]:.2f}" for per in scores.values()), f"{event.rewards[row]:.2f}"]
            for column, text in enumerate(cells):
                item = QTableWidgetItem(_one_line(text))  # one line a row; the tooltip keeps the lines
                item.setToolTip(text)
                table.setItem(row, column, item)
        header = table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)

    def cells(self) -> list[list[str]]:
        """The table as a user reads it, row by row."""
        table = self.table
        rows = range(table.rowCount())
        return [[_text(table.item(r, c)) for c in range(table.columnCount())] for r in rows]

    def headings(self) -> list[str]:
        return [_text(self.table.horizontalHeaderItem(c)) for c in range(self.table.columnCount())]


def _text(item: QTableWidgetItem | None) -> str:
    return item.text() if item is not None else ""


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "(empty answer)"
