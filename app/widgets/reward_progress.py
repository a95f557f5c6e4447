"""The Run page's view of a run that learns from rewards: its reward charts and the answers it samples.

It shows for a method whose report is judged by rewards (engine.method_facts: GRPO today) and stays hidden for the
others, which keep the page's loss and memory charts alone. Every run starts it empty.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from PySide6.QtWidgets import QVBoxLayout, QWidget

from app.widgets.reward_charts import RewardCharts
from app.widgets.sampled_answers import SampledAnswers
from engine.config import RunConfig
from engine.events import AnswersSampled, EvalMetrics, RunStarted, StepMetrics
from engine.method_facts import facts_for

CHARTS_HEIGHT = 240
"""The charts' smallest height: at 1366×768 the page scrolls to them rather than squeezing them to a strip."""
CHARTS_MAX_HEIGHT = 380
"""With the answers under them, the view fits a laptop's page (1366×768) scrolled to it."""
ANSWERS_HEIGHT = 210


def learns_from_rewards(config: RunConfig) -> bool:
    return facts_for(config.training.method).report == "rewards"


class RewardProgress(QWidget):
    """Mean reward, answer length and KL per step, and the latest sampled answers with their scores."""

    def __init__(self) -> None:
        super().__init__()
        self.charts = RewardCharts()
        self.charts.setMinimumHeight(CHARTS_HEIGHT)
        self.charts.setMaximumHeight(CHARTS_MAX_HEIGHT)
        self.answers = SampledAnswers()
        self.answers.setFixedHeight(ANSWERS_HEIGHT)  # four answers a step: more height is empty rows
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.charts, 1)
        layout.addWidget(self.answers)
        self.setMaximumHeight(CHARTS_MAX_HEIGHT + ANSWERS_HEIGHT + layout.spacing())  # the page's charts get the rest
        self.hide()

    def begin(self, config: RunConfig) -> None:
        """A run starts: shown, empty, for a run that learns from rewards; hidden for any other."""
        self.charts.clear()
        training = config.training
        self.answers.clear([spec.weight for spec in training.rewards] if learns_from_rewards(config) else [])
        self.charts.set_kl_penalty(bool(training.kl_beta))
        self.setVisible(learns_from_rewards(config))

    def on_event(self, event: object) -> None:
        if isinstance(event, StepMetrics):
            self.charts.add_step(event)
        elif isinstance(event, EvalMetrics) and event.reward_mean is not None:
            self.charts.add_held_out(event.step, event.reward_mean)
        elif isinstance(event, AnswersSampled):
            self.answers.show_answers(event)
        elif isinstance(event, RunStarted) and event.start_step > 0 and not self.isHidden():
            self.load_history(Path(event.run_dir), event.start_step)

    def load_history(self, run_dir: Path, up_to_step: int) -> None:
        """A resumed run's reward curves start where it stopped: the steps and evaluations already in its logs."""
        for record in _logged(run_dir / "metrics.jsonl", up_to_step):
            with contextlib.suppress(TypeError):  # a line of another version's fields
                self.charts.add_step(StepMetrics(**record))
        for record in _logged(run_dir / "eval.jsonl", up_to_step):
            if record.get("reward_mean") is not None:
                self.charts.add_held_out(int(record["step"]), float(record["reward_mean"]))


def _logged(path: Path, up_to_step: int) -> list[dict[str, Any]]:
    """The records of a run's log up to ``up_to_step`` (unreadable lines left out)."""
    records = []
    with contextlib.suppress(OSError):
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                record = json.loads(line)
                if int(record["step"]) <= up_to_step:
                    records.append(record)
    return records
