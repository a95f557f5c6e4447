"""Setup page: a preset (quick test, balanced, thorough) and the advanced form built from the engine's config.

The model and dataset come from their pages. Before a run, the planner checks the settings against the GPU and
says when they will not fit, so a user learns it here rather than from an out-of-memory error.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QScrollArea, QVBoxLayout, QWidget

from app.app_state import AppState
from app.config_form import ConfigForm
from engine.config import DEMO_MODEL, DataConfig, RunConfig
from engine.errors import TuneDeckError

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "Quick test": {"training": {"max_steps": 30, "eval_every": 0, "save_every": 0}, "lora": {"rank": 8, "alpha": 16.0}},
    "Balanced": {"training": {"max_steps": 0, "epochs": 1.0, "eval_every": 50, "save_every": 50}},
    "Thorough": {
        "training": {"max_steps": 0, "epochs": 3.0, "learning_rate": 1e-4, "eval_every": 100, "save_every": 100},
        "lora": {"rank": 32, "alpha": 64.0},
    },
    "Demo recipe": {
        "data": {"max_seq_len": 128, "tokens_per_batch": 1024, "eval_fraction": 0.02},
        "lora": {"rank": 16, "alpha": 32.0},
        "training": {"max_steps": 60, "learning_rate": 2e-3, "warmup_steps": 5, "eval_every": 0, "save_every": 20},
    },
}
CHOSEN_ELSEWHERE = frozenset({"model.name", "data.path"})


def preset_config(name: str) -> RunConfig:
    raw = RunConfig().to_dict()
    for section, values in PRESETS[name].items():
        raw[section].update(values)
    return RunConfig.from_dict(raw)


def fit_warning(config: RunConfig, model_info: Any, hardware: Any) -> str | None:
    """The planner's objection to these settings on this GPU, or None when they fit (or cannot be judged)."""
    if model_info is None or model_info.shape is None or hardware is None:
        return None
    from engine.hardware.profile import build_profile

    overrides: dict[str, Any] = {"qlora": config.model.qlora, "tokens_per_batch": config.data.tokens_per_batch}
    if config.speed.checkpointing != "auto":
        overrides["checkpointing"] = config.speed.checkpointing
    if config.speed.chunked_mlp is not None:
        overrides["chunked_mlp"] = config.speed.chunked_mlp
    profile = build_profile(
        hardware, model_info.shape, overrides=overrides, lora_rank=config.lora.rank, min_tokens=config.data.max_seq_len
    )
    plan = profile.memory_plan
    if plan is None or plan.fits:
        return None
    reason = plan.reasons.get("fit", "predicted peak above usable memory").removeprefix("does not fit: ")
    return f"Will not fit on this GPU: {reason}"


class SetupPanel(QWidget):
    """Preset choice, the generated form, and the planner's verdict on the current settings."""

    def __init__(self, state: AppState) -> None:
        super().__init__()
        self.state = state
        self.preset = QComboBox()
        self.preset.addItems(list(PRESETS))
        self.preset.currentTextChanged.connect(self.apply_preset)
        self.form = ConfigForm(CHOSEN_ELSEWHERE)
        self.warning = QLabel("")
        self.warning.setWordWrap(True)
        self.warning.setStyleSheet("color:#b00020")
        self.chosen = QLabel("")
        scroll = QScrollArea()
        scroll.setWidget(self.form)
        scroll.setWidgetResizable(True)
        top = QHBoxLayout()
        top.addWidget(QLabel("Preset:"))
        top.addWidget(self.preset)
        top.addStretch(1)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.chosen)
        layout.addWidget(self.warning)
        layout.addWidget(scroll, 1)
        self._check_timer = QTimer(self, singleShot=True, interval=300)
        self._check_timer.timeout.connect(self.check_fit)
        for editor, _ in self.form.editors.values():
            for signal in ("textChanged", "valueChanged", "currentTextChanged", "toggled"):
                if hasattr(editor, signal):
                    getattr(editor, signal).connect(self._check_timer.start)
        state.model_changed.connect(self._model_changed)
        state.data_changed.connect(self._update_chosen)
        self.preset.setCurrentText("Demo recipe")
        self._update_chosen()

    def apply_preset(self, name: str) -> None:
        self.form.set_config(preset_config(name))

    def build_config(self) -> RunConfig:
        """The run's config: the form, the chosen model and dataset; raises ConfigError on a bad value."""
        raw = self.form.values()
        raw["model"]["name"] = self.state.model_name
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
        try:
            raw = self.form.values()
            raw["model"]["name"] = self.state.model_name
            config = RunConfig.from_dict(raw)
        except TuneDeckError as err:
            self.warning.setText(str(err))
            return
        self.warning.setText(fit_warning(config, self.state.model_info, self.state.hardware) or "")

    def _model_changed(self) -> None:
        if self.state.model_name != DEMO_MODEL and self.preset.currentText() == "Demo recipe":
            self.preset.setCurrentText("Balanced")
        self._update_chosen()
        self.check_fit()

    def _update_chosen(self) -> None:
        data = self.state.data_path or "none yet (Dataset page)"
        self.chosen.setText(f"Model: <b>{self.state.model_name}</b> · Dataset: <b>{data}</b>")
