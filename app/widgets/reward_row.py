"""One chosen reward on the Recipe page: its kind, its main setting, one option, its weight and, under it, why it
cannot be built (a bad regular expression, a missing file, a file without ``reward``).

A row's fields map to the ``--reward`` text the command line takes (:func:`reward_flag`), so the app and the
command line build the same reward from the same words, and the row can show that text for a script.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QGridLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QWidget,
)

from engine.rewards import RewardError, RewardSpec, build_rewards, parse_reward_flag

ERROR_COLOUR = "#b00020"
KIND_TITLES = {
    "regex": "Matches a regular expression",
    "reference": "Says the reference answer",
    "json": "Is a JSON object",
    "length": "Length within a window",
    "python": "My Python file",
}
PLACEHOLDERS = {
    "regex": r"pattern, e.g. ^\d+$ or <answer>.*</answer>",
    "reference": "column (empty: answer, else reference)",
    "json": "required keys, e.g. name,age (empty: any object)",
    "length": "MIN-MAX, e.g. 20-200 (or 20- or -200)",
    "python": "a .py file with reward(prompt, completion, **row)",
}
OPTIONS = {
    "regex": ("found anywhere", "the whole answer"),
    "reference": ("equals", "contains"),
    "json": ("a lone ```json block counts", "plain JSON only"),
    "length": ("characters", "words"),
    "python": (),
}
DEFAULT_TEXT = {"regex": "", "reference": "", "json": "", "length": "20-200", "python": ""}


def reward_flag(kind: str, text: str, option: int) -> str:
    """The ``--reward`` text (without a weight) for a row's fields."""
    text = text if kind in ("regex", "python") else text.strip()
    if kind == "regex":
        return f"{'regex-full' if option else 'regex'}:{text}"
    if kind == "reference":
        return f"reference:{OPTIONS['reference'][option]}" + (f":column={text}" if text else "")
    if kind == "json":
        return "json" + (f":keys={text}" if text else "") + (":fenced=no" if option else "")
    if kind == "length":
        return f"length:{text}:{'words' if option else 'chars'}"
    return f"python:{text}"


def row_spec(kind: str, text: str, option: int, weight: float) -> RewardSpec:
    """The reward a row describes, built once to check it (a python file is loaded); RewardError says why not."""
    flag = reward_flag(kind, text, option)
    try:
        spec = dataclasses.replace(parse_reward_flag(flag), weight=weight)
    except RewardError as error:  # the command line's wording names the flag; a row shows only the problem
        raise RewardError(error.message.removeprefix(f"--reward {flag!r}: ")) from None
    build_rewards([spec])
    return spec


class RewardRow(QWidget):
    """The editors of one reward; ``changed`` when any of them is edited, ``removed`` when its × is pressed."""

    changed = Signal()
    removed = Signal()

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.title = KIND_TITLES[kind]
        self._checked: tuple[tuple[str, int, float, int | None], RewardSpec | None, str] | None = None
        """The last check: (the fields and the file's time, its reward, its problem)."""
        self.text = QLineEdit(DEFAULT_TEXT[kind])
        self.text.setPlaceholderText(PLACEHOLDERS[kind])
        self.option = QComboBox()
        self.option.addItems(OPTIONS[kind])
        self.option.setVisible(bool(OPTIONS[kind]))
        self.weight = QDoubleSpinBox(minimum=-100.0, maximum=100.0, singleStep=0.1, value=1.0, decimals=2)
        self.weight.setPrefix("weight ")
        self.weight.setToolTip("The reward's share of the total: total = sum of weight × score (negative: penalty)")
        self.error = QLabel("")
        self.error.setWordWrap(True)
        self.error.setStyleSheet(f"color:{ERROR_COLOUR}")
        remove = QPushButton("×")
        remove.setFixedWidth(28)
        remove.setToolTip("Remove this reward")
        remove.clicked.connect(self.removed.emit)
        grid = QGridLayout(self)
        grid.setContentsMargins(0, 2, 0, 2)
        grid.addWidget(QLabel(f"<b>{self.title}</b>"), 0, 0)
        grid.addWidget(self.text, 0, 1)
        grid.addWidget(self.option, 0, 2)
        if kind == "python":
            choose = QPushButton("Choose…")
            choose.clicked.connect(self.choose_file)
            grid.addWidget(choose, 0, 2)
        grid.addWidget(self.weight, 0, 3)
        grid.addWidget(remove, 0, 4)
        grid.addWidget(self.error, 1, 0, 1, 5)
        grid.setColumnStretch(1, 1)
        self.error.hide()
        # a python file runs when checked: check it when its path is complete, not at every key
        text_signal = self.text.editingFinished if kind == "python" else self.text.textChanged
        for signal in (text_signal, self.option.currentIndexChanged, self.weight.valueChanged):
            signal.connect(lambda *_: self.changed.emit())

    def choose_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Reward file", "", "Python files (*.py)")
        if path:
            self.text.setText(path)
            self.changed.emit()

    def _fields(self) -> tuple[str, int, float, int | None]:
        """What the row's reward depends on; a python file's modification time too, so an edited file is reread."""
        text = self.text.text()
        stamp = Path(text).stat().st_mtime_ns if self.kind == "python" and text and Path(text).is_file() else None
        return (text, self.option.currentIndex(), self.weight.value(), stamp)

    def check(self) -> RewardSpec | None:
        """The row's reward, or None with its problem shown under it (a row unchanged since its last check is not
        built again, so a user's file runs once per edit)."""
        fields = self._fields()
        if self._checked is None or self._checked[0] != fields:
            text, option, weight, _ = fields
            try:
                self._checked = (fields, row_spec(self.kind, text, option, weight), "")
            except RewardError as error:
                self._checked = (fields, None, str(error))
        _, spec, problem = self._checked
        self.error.setText(problem)
        self.error.setVisible(bool(problem))
        return spec
