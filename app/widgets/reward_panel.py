"""The reward builder on the Recipe page, shown when the method is training by reward (GRPO).

The user adds built-in rewards or a Python file, each with a weight; each row says under itself why it cannot be
built. "Try on 4 prompts" loads the base model in the background (the app's task runner), lets it answer the
dataset's first four prompts greedily and shows every reward's score of every answer, so a user sees before a run
whether the rewards tell answers apart. :meth:`RewardPanel.specs` gives the chosen rewards to the run's config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidgetItem,
    QVBoxLayout,
)

from app.app_state import AppState
from app.background.worker import ErrorInfo, TaskRunner
from app.widgets.reward_row import ERROR_COLOUR, KIND_TITLES, RewardRow
from app.widgets.tables import read_only_table
from engine.rewards import RewardError, RewardSpec

if TYPE_CHECKING:  # the trial loads torch: only when it runs, so the window opens without it
    from engine.run.reward_trial import RewardTrial

TRIAL_PROMPTS = 4
TRY_TEXT = f"Try on {TRIAL_PROMPTS} prompts"


class RewardPanel(QGroupBox):
    """Chosen rewards, their problems, and a trial of them on the base model's answers."""

    changed = Signal()
    """A reward was added, removed or edited (and checked)."""
    tried = Signal()
    """A trial finished, with scores or an error."""

    def __init__(self, state: AppState, tasks: TaskRunner) -> None:
        super().__init__("Rewards: how an answer is scored")
        self.state, self.tasks = state, tasks
        self.rows: list[RewardRow] = []
        self.trying = False
        """A trial is under way (one at a time)."""
        self.kind = QComboBox()
        for kind, title in KIND_TITLES.items():
            self.kind.addItem(title, kind)
        add = QPushButton("Add reward")
        add.clicked.connect(lambda: self.add_reward(str(self.kind.currentData())))
        self.try_button = QPushButton(TRY_TEXT)
        self.try_button.setToolTip("The base model answers the dataset's first prompts (greedy: its likeliest answer)")
        self.try_button.clicked.connect(self.try_rewards)
        self.status = QLabel("Add at least one reward.")
        self.status.setWordWrap(True)
        self.trial_status = QLabel("")
        self.trial_status.setWordWrap(True)
        self.results = read_only_table(["Row", "Prompt", "Answer"])
        self.results.hide()
        bar = QHBoxLayout()
        for widget in (self.kind, add, self.try_button):
            bar.addWidget(widget)
        bar.addStretch(1)
        self.list = QVBoxLayout()
        layout = QVBoxLayout(self)
        layout.addLayout(bar)
        layout.addLayout(self.list)
        layout.addWidget(self.status)
        layout.addWidget(self.trial_status)
        layout.addWidget(self.results)
        self._check_timer = QTimer(self, singleShot=True, interval=300)
        self._check_timer.timeout.connect(self.check)
        self.check()

    def add_reward(self, kind: str) -> RewardRow:
        row = RewardRow(kind)
        row.changed.connect(self._check_timer.start)
        row.removed.connect(lambda: self.remove_reward(row))
        self.rows.append(row)
        self.list.addWidget(row)
        self.check()
        return row

    def remove_reward(self, row: RewardRow) -> None:
        self.rows.remove(row)
        self.list.removeWidget(row)
        row.hide()
        row.deleteLater()
        self.check()

    def check(self) -> list[RewardSpec | None]:
        """Every row checked (its problem shown under it); the status and the Try button follow."""
        checked = [row.check() for row in self.rows]
        bad = sum(spec is None for spec in checked)
        self.status.setStyleSheet(f"color:{ERROR_COLOUR}" if bad else "")
        if not self.rows:
            self.status.setText("Add at least one reward.")
        elif bad:
            self.status.setText(f"{bad} of {len(self.rows)} rewards cannot be built: see under each.")
        else:
            count = f"{len(self.rows)} reward" + ("s" if len(self.rows) > 1 else "")
            self.status.setText(f"{count}; an answer's total is the weighted sum of their scores.")
        self.try_button.setEnabled(bool(self.rows) and not bad and not self.trying)
        self.changed.emit()
        return checked

    def specs(self) -> tuple[RewardSpec, ...]:
        """The chosen rewards for the run's config; RewardError when there are none or one cannot be built."""
        if not self.rows:
            raise RewardError("no reward chosen", hint="add one in the Recipe page's rewards")
        checked = [row.check() for row in self.rows]
        for row, spec in zip(self.rows, checked, strict=True):
            if spec is None:
                raise RewardError(f"{row.title}: {row.error.text()}")
        return tuple(spec for spec in checked if spec is not None)

    def try_rewards(self) -> None:
        """Answer and score the trial prompts in the background."""
        try:
            specs = self.specs()
        except RewardError as error:
            self._failed(ErrorInfo(error.message, error.hint))
            return
        if not self.state.data_path:
            self._failed(ErrorInfo("no dataset chosen", "open one of prompts on the Dataset page"))
            return
        model, data = self.state.model_name, self.state.data_path
        self.trying = True
        self.try_button.setEnabled(False)
        self.trial_status.setStyleSheet("")
        self.trial_status.setText(f"Loading {model} and answering {TRIAL_PROMPTS} prompts (greedy)…")

        def job() -> RewardTrial:
            from engine.run.reward_trial import try_rewards

            return try_rewards(model, data, specs, limit=TRIAL_PROMPTS)

        self.tasks.start(job, lambda trial: self._show_trial(trial, specs), self._failed)

    def _show_trial(self, trial: RewardTrial, specs: tuple[RewardSpec, ...]) -> None:
        pairs = zip(trial.scores.names, specs, strict=True)
        names = [name if spec.weight == 1 else f"{name} ×{spec.weight:g}" for name, spec in pairs]
        table = self.results
        table.setColumnCount(4 + len(names))
        table.setHorizontalHeaderLabels(["Row", "Prompt", "Answer", *names, "Total"])
        table.setRowCount(len(trial.answers))
        for index, (prompt, answer) in enumerate(zip(trial.prompts, trial.answers, strict=True)):
            scores = [per[index] for per in trial.scores.per_reward]
            cells = [str(prompt.row_number), prompt.prompt, answer, *(f"{s:.2f}" for s in scores)]
            for column, text in enumerate([*cells, f"{trial.scores.total[index]:.2f}"]):
                item = QTableWidgetItem(" ".join(text.split()))  # one line a row; the tooltip keeps the lines
                item.setToolTip(text)
                table.setItem(index, column, item)
        header = table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        for column in (1, 2):
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.Stretch)
        table.show()
        means = ", ".join(f"{name} {mean:.2f}" for name, mean in trial.scores.means().items())
        self.trial_status.setText(f"Scores of the base model's answers (mean: {means}).")
        self._trial_ended()

    def _failed(self, error: ErrorInfo) -> None:
        self.trial_status.setStyleSheet(f"color:{ERROR_COLOUR}")
        self.trial_status.setText(error.message + (f" ({error.hint})" if error.hint else ""))
        self._trial_ended()

    def _trial_ended(self) -> None:
        self.trying = False
        self.check()
        self.tried.emit()
