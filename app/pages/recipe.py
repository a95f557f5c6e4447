"""Recipe page: a recipe (quick test, balanced, long context, best quality; the demo's own for the demo model),
the main settings in plain words, and the full form behind "Advanced".

Each recipe shows what the planner predicts for it on this card (peak memory, steps, time), so a user sees what
a choice costs before the run. The model and dataset come from their pages; a recipe never changes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from PySide6.QtCore import QTimer, Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QComboBox,
    QGridLayout,
    QGroupBox,
    QLabel,
    QRadioButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from app.app_state import AppState
from app.background.worker import TaskRunner
from app.widgets.config_form import ConfigForm
from app.widgets.model_words import machine_name
from app.widgets.reward_panel import RewardPanel
from engine.config import DEMO_MODEL, DataConfig, RunConfig
from engine.errors import TuneDeckError
from engine.hardware.recipes import (
    AUTOMATIC_RECIPE,
    DEMO_RECIPE,
    RECIPES,
    Recipe,
    RecipeEstimate,
    apply_recipe,
    describe_peak,
    estimate_recipe,
    find_recipe,
)
from engine.rewards import RewardError
from engine.run.estimate import TimeEstimate, before_start, format_duration
from engine.vision.recipe import ImageLoad, image_estimate_for

QUICK_TEST, ONE_PASS = "Quick test", "Balanced"
CHOSEN_ELSEWHERE = frozenset({"model.name", "data.path"})
ERROR_COLOUR = "#b00020"
REWARD_METHOD = "grpo"
"""The training method that learns from rewards: the reward builder shows only for it."""


def recipe_config(name: str, base: RunConfig | None = None) -> RunConfig:
    """``base`` (the defaults when None) with the recipe's settings."""
    return apply_recipe(base or RunConfig(), find_recipe(name))


def planned(config: RunConfig, shape: Any, hardware: Any, report: Any = None) -> RecipeEstimate:
    """The planner's estimate of ``config`` on ``hardware`` for the chosen dataset (``report``): a picture run's,
    with the vision tower, the image tokens and the pixel budget, for a vision-language model and an image
    dataset; else a text run's."""
    found = image_estimate_for(config, shape, hardware, report)
    if found is not None:
        return found
    return estimate_recipe(config, shape, hardware, dataset_tokens(report), dataset_examples(report))


def fit_warning(config: RunConfig, model_info: Any, hardware: Any, report: Any = None) -> str | None:
    """The planner's objection to these settings on this machine's GPU (or CPU), or None when they fit (or cannot
    be judged)."""
    if model_info is None or model_info.shape is None or hardware is None:
        return None
    estimate = planned(config, model_info.shape, hardware, report if ImageLoad.from_report(report) else None)
    return None if estimate.fits else f"Will not fit on {machine_name(hardware)}: {estimate.reason}"


def describe_estimate(estimate: RecipeEstimate, time: TimeEstimate) -> str:
    """One line: 'predicted 2.1 of 7.5 GiB · 480 steps · about 25 min (the planner's figure for this card)', or why
    it does not fit."""
    if not estimate.fits:
        return f"<span style='color:{ERROR_COLOUR}'>does not fit: {estimate.reason}</span>"
    parts = []
    if describe_peak(estimate):
        parts.append(f"predicted {describe_peak(estimate)}")
    if estimate.steps is not None:
        parts.append(f"{estimate.steps:,} steps")
    if time.seconds:
        parts.append(f"about {format_duration(time.seconds)} ({time.basis})")
    else:
        parts.append(f"time {time.basis}")
    return " · ".join(parts)


def time_estimate(estimate: RecipeEstimate, config: RunConfig, state: AppState) -> TimeEstimate:
    """How long ``config`` trains on this machine: from earlier runs measured here, else the planner's figure."""
    hardware = state.hardware
    gpu_class = str(getattr(hardware, "gpu_class", "cpu"))
    gpu = getattr(hardware, "primary", hardware)
    gpu_name = "" if gpu_class == "cpu" else str(getattr(gpu, "name", "") or "")
    tokens_per_step = (estimate.tokens_per_batch or config.data.tokens_per_batch) * config.training.grad_accum
    planner = None
    if estimate.seconds and estimate.steps and tokens_per_step:
        planner = estimate.steps * tokens_per_step / estimate.seconds
    return before_start(steps=estimate.steps, tokens_per_step=tokens_per_step, gpu_class=gpu_class,
                        gpu_name=gpu_name, model=config.model.name, qlora=config.model.qlora, rows=state.measured,
                        planner_tokens_per_s=planner, method=config.training.method)  # fmt: skip


def dataset_examples(report: Any) -> int | None:
    """Usable examples in the dataset (what the automatic settings are fitted to)."""
    if report is None or not report.lengths:
        return None
    return int(max(report.good_rows, len(report.lengths)))


def dataset_tokens(report: Any) -> int | None:
    """Tokens in the whole dataset (the report tokenizes a sample of large ones: scaled up)."""
    if report is None or not report.lengths:
        return None
    return int(report.total_tokens * max(report.good_rows, len(report.lengths)) / len(report.lengths))


class SetupPanel(QWidget):
    """Recipe choice with the planner's estimates, the main settings, and the full form behind "Advanced"."""

    changed = Signal()
    """The recipe, a setting or the verdict changed (the guide bar listens)."""

    def __init__(self, state: AppState, tasks: TaskRunner | None = None) -> None:
        super().__init__()
        self.state = state
        self.buttons: dict[str, QRadioButton] = {}
        self.estimates: dict[str, QLabel] = {}
        self.summaries: dict[str, QLabel] = {}
        self.group = QButtonGroup(self)
        self.form = ConfigForm(CHOSEN_ELSEWHERE)
        self.rewards = RewardPanel(state, tasks or TaskRunner(self))
        """The rewards of training by reward (GRPO), shown only for that method."""
        self.warning = QLabel("")
        self.warning.setWordWrap(True)
        self.warning.setStyleSheet(f"color:{ERROR_COLOUR}")
        self.chosen = QLabel("")
        self.chosen.setWordWrap(True)
        content = QWidget()
        column = QVBoxLayout(content)
        column.addWidget(self._recipe_box())
        column.addWidget(self.rewards)
        column.addWidget(self.form, 1)
        scroll = QScrollArea()
        scroll.setWidget(content)
        scroll.setWidgetResizable(True)
        layout = QVBoxLayout(self)
        layout.addWidget(self.chosen)
        layout.addWidget(self.warning)
        layout.addWidget(scroll, 1)
        self._check_timer = QTimer(self, singleShot=True, interval=300)
        self._check_timer.timeout.connect(self.check_fit)
        for editor, _ in self.form.editors.values():
            for signal in ("textChanged", "valueChanged", "currentTextChanged", "toggled"):
                if hasattr(editor, signal):
                    getattr(editor, signal).connect(self._check_timer.start)
        self.rewards.changed.connect(self._check_timer.start)  # the rewards are part of the config
        method = self.form.editor("training.method")
        method.currentTextChanged.connect(self._method_changed)  # type: ignore[attr-defined]
        self._method_changed(method.currentText())  # type: ignore[attr-defined]
        state.model_changed.connect(self._model_changed)
        state.data_changed.connect(self._data_changed)
        state.hardware_changed.connect(self.check_fit)
        self.choose_recipe(DEMO_RECIPE)
        self._update_chosen()

    def _method_changed(self, method: str) -> None:
        self.rewards.setVisible(method == REWARD_METHOD)
        self.changed.emit()

    def _recipe_box(self) -> QGroupBox:
        box = QGroupBox("Recipe: a starting point for the settings below")
        grid = QGridLayout(box)
        grid.setColumnStretch(1, 1)
        for row, recipe in enumerate(RECIPES):
            button = QRadioButton(recipe.name)
            button.setStyleSheet("font-weight:bold")
            button.toggled.connect(lambda on, name=recipe.name: self.apply_recipe(name) if on else None)
            summary = QLabel(recipe.summary)
            summary.setWordWrap(True)
            estimate = QLabel("")
            estimate.setMinimumWidth(260)
            estimate.setToolTip("The planner's prediction on this computer: peak memory, steps and training time")
            self.group.addButton(button)
            self.buttons[recipe.name], self.estimates[recipe.name] = button, estimate
            self.summaries[recipe.name] = summary
            for column, widget in enumerate((button, summary, estimate)):
                grid.addWidget(widget, row, column)
        return box

    def recipe_name(self) -> str:
        checked = self.group.checkedButton()
        return checked.text() if checked is not None else ""

    def choose_recipe(self, name: str) -> None:
        """Select a recipe as if clicked (its settings replace the form's)."""
        button = self.buttons[name]
        if button.isChecked():
            self.apply_recipe(name)
        button.setChecked(True)

    def apply_recipe(self, name: str) -> None:
        self.form.set_config(self._with_recipe(self._form_config() or RunConfig(), find_recipe(name)))
        self.check_fit()

    def _settings(self) -> dict[str, Any]:
        """The form's values with the chosen model and, when the method trains by reward, the rewards (a
        RewardError when one cannot be built)."""
        raw = self.form.values()
        raw["model"]["name"] = self.state.model_name
        if self.learns_from_rewards():
            raw["training"]["rewards"] = list(self.rewards.specs())
        return raw

    def _with_recipe(self, config: RunConfig, recipe: Recipe) -> RunConfig:
        """``config`` with ``recipe``'s settings; a quick test never takes more steps than one pass over the data
        (Balanced) would on this machine."""
        settings = apply_recipe(config, recipe)
        info, hardware = self.state.model_info, self.state.hardware
        if recipe.name != QUICK_TEST or info is None or info.shape is None or hardware is None:
            return settings
        balanced = apply_recipe(config, find_recipe(ONE_PASS))
        one_pass = planned(balanced, info.shape, hardware, self.state.data_report).steps
        if one_pass is None or one_pass >= settings.training.max_steps:
            return settings
        return dataclasses.replace(settings, training=dataclasses.replace(settings.training, max_steps=one_pass))

    def _form_config(self) -> RunConfig | None:
        try:
            return RunConfig.from_dict(self._settings())
        except TuneDeckError:
            return None

    def build_config(self) -> RunConfig:
        """The run's config: the form, the chosen model and dataset; raises ConfigError on a bad value."""
        raw = self._settings()
        raw["data"]["path"] = self.state.data_path
        if not self.state.data_path:
            raise TuneDeckError("no dataset chosen", hint="open one on the Dataset page")
        return RunConfig.from_dict(raw)

    def data_settings(self, path: str) -> DataConfig:
        """The form's data settings for ``path`` (defaults where the form has a bad value)."""
        raw = self.form.values()["data"]
        try:
            return DataConfig(**{**raw, "path": path})
        except (TuneDeckError, TypeError):
            return DataConfig(path=path)

    def check_fit(self) -> None:
        """The verdict on the current settings, and each recipe's estimate with the user's other choices."""
        try:
            config = RunConfig.from_dict(self._settings())
        except TuneDeckError as err:
            self.warning.setText(str(err))
            self.changed.emit()
            return
        warning = fit_warning(config, self.state.model_info, self.state.hardware, self.state.data_report)
        self.warning.setText(warning or "")
        self._show_estimates(config)
        self.changed.emit()

    def _show_estimates(self, config: RunConfig) -> None:
        """Each recipe's line, and the plan for the current settings (the Run page shows it before Start)."""
        info, hardware = self.state.model_info, self.state.hardware
        if info is None or info.shape is None or hardware is None:
            for label in self.estimates.values():
                label.setText("")
            self.state.set_plan(None, None)
            return
        report = self.state.data_report
        for recipe in RECIPES:
            if self.state.model_name == DEMO_MODEL or not recipe.demo_only:
                settings = self._with_recipe(config, recipe)
                estimate = planned(settings, info.shape, hardware, report)
                self.estimates[recipe.name].setText(describe_estimate(estimate, time_estimate(estimate, settings,
                                                                                              self.state)))  # fmt: skip
        current = planned(config, info.shape, hardware, report)
        if not current.fits:
            self.state.set_plan(None, None, current, self.recipe_name())
            return
        time = time_estimate(current, config, self.state)
        self.state.set_plan(current.peak_bytes, time, current, self.recipe_name())

    def step_status(self) -> tuple[bool, str]:
        """(ready, what to say) for the guide: the recipe, or what stops it."""
        problem = self.warning.text()
        if problem:
            return False, f"Change the recipe: {problem[:1].lower()}{problem[1:]}"
        if self.learns_from_rewards():
            try:
                self.rewards.specs()
            except RewardError as error:
                return False, f"Fix the rewards: {error.message}"
        return True, f"{self.recipe_name()} recipe"

    def learns_from_rewards(self) -> bool:
        """Whether the chosen method trains by reward (the reward builder shows, and its rewards must build)."""
        method = self.form.editor("training.method")
        return isinstance(method, QComboBox) and method.currentText() == REWARD_METHOD

    def _model_changed(self) -> None:
        demo = self.state.model_name == DEMO_MODEL
        for recipe in RECIPES:
            for widgets in (self.buttons, self.summaries, self.estimates):
                widgets[recipe.name].setVisible(demo or not recipe.demo_only)
        current = find_recipe(self.recipe_name()) if self.recipe_name() else None
        if demo and current is not None and current.name != DEMO_RECIPE and self._untouched(current):
            self.choose_recipe(DEMO_RECIPE)
        elif not demo and (current is None or current.demo_only):
            self.choose_recipe(AUTOMATIC_RECIPE)
        info = self.state.model_info
        if info is not None and info.verdict in ("fits", "needs QLoRA"):  # the planner's choice for this card
            self.form.set_values({"model.qlora": info.verdict == "needs QLoRA"})
        self._update_chosen()
        self.check_fit()

    def _untouched(self, recipe: Recipe) -> bool:
        """Whether the form still holds the recipe's settings as the recipe set them."""
        config = self._form_config()
        return config is not None and apply_recipe(config, recipe) == config

    def _data_changed(self) -> None:
        self._update_chosen()
        self.check_fit()

    def _update_chosen(self) -> None:
        data = self.state.data_path or "none yet (Dataset page)"
        self.chosen.setText(f"Model: <b>{self.state.model_name}</b> · Dataset: <b>{data}</b>")
