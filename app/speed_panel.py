"""Speed page: the speed optimizations, live. Each says whether it applies here and why; flipping one takes
effect at the next step (the tokens/s chart marks it), and Compare measures each one on the running job.
"""

from __future__ import annotations

import dataclasses
import html
from typing import Any, Literal, cast

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.ab_compare import ON_OFF_SWITCHES, SWITCHES, TITLES, ABCompare, nothing_to_do
from app.app_state import AppState
from app.run_controller import RUNNING, RunController
from engine.config import SpeedConfig
from engine.events import RunFailed, RunFinished, SpeedChanged, StepMetrics

CHECKPOINT_MODES = ("none", "standard", "offloaded")
Checkpointing = Literal["auto", "none", "standard", "offloaded"]


class SpeedPanel(QWidget):
    """Switches with reasons, and the A/B Compare action."""

    def __init__(self, state: AppState, controller: RunController) -> None:
        super().__init__()
        self.state, self.controller = state, controller
        self.on_off = {name: QCheckBox("on") for name in SWITCHES if name in ON_OFF_SWITCHES}
        self.metadata_box = self.on_off["metadata_cache"]
        self.checkpoint_box = QComboBox()
        self.checkpoint_box.addItems(CHECKPOINT_MODES)
        self.moe_box = QCheckBox("on")
        self.controls: dict[str, QWidget] = {
            **self.on_off,
            "checkpointing": self.checkpoint_box,
            "moe_routing": self.moe_box,
        }
        self.reasons = {name: _wrapping_label("known once the GPU is detected") for name in SWITCHES}
        self.results = {name: _wrapping_label("") for name in SWITCHES}
        self.rounds = QSpinBox(minimum=1, maximum=10, value=3)
        self.block = QSpinBox(minimum=2, maximum=20, value=3)
        self.compare_button = QPushButton("Compare (A/B on this run)")
        self.compare_button.clicked.connect(self.start_compare)
        self.compare_status = _wrapping_label("Compare alternates each switch on and off for a few steps per round.")
        self._build()
        self._updating = False
        for name, box in self.on_off.items():
            box.toggled.connect(lambda _=False, name=name: self._flip(name))
        self.moe_box.toggled.connect(lambda _: self._flip("moe_routing"))
        self.checkpoint_box.currentTextChanged.connect(lambda _: self._flip("checkpointing"))
        self.queue: list[str] = []
        self.compare: ABCompare | None = None
        controller.run_event.connect(self.on_event)
        controller.state_changed.connect(self._state_changed)
        state.hardware_changed.connect(self.show_plan)
        state.model_changed.connect(self.show_plan)
        self._state_changed(controller.state)

    def _build(self) -> None:
        grid = QGridLayout()
        for column, title in enumerate(("Optimization", "Switch", "Applies here? Why", "Measured")):
            grid.addWidget(QLabel(f"<b>{title}</b>"), 0, column)
        for row, name in enumerate(SWITCHES, start=1):
            grid.addWidget(QLabel(TITLES[name]), row, 0)
            grid.addWidget(self.controls[name], row, 1)
            grid.addWidget(self.reasons[name], row, 2)
            grid.addWidget(self.results[name], row, 3)
        grid.setColumnStretch(2, 2)
        grid.setColumnStretch(3, 2)
        compare = QHBoxLayout()
        for widget in (self.compare_button, QLabel("rounds"), self.rounds, QLabel("steps per block"), self.block):
            compare.addWidget(widget)
        compare.addStretch(1)
        layout = QVBoxLayout(self)
        layout.addWidget(_wrapping_label("Flip a switch during a run: it applies from the next step, and the "
                                         "tokens/s chart on the Run page marks the moment."))  # fmt: skip
        layout.addLayout(grid)
        layout.addLayout(compare)
        layout.addWidget(self.compare_status)
        layout.addStretch(1)

    def _state_changed(self, state: str) -> None:
        """Switches work on a live run only; before one, the Setup page's speed settings apply."""
        for control in self.controls.values():
            control.setEnabled(self.controller.active)
        self.compare_button.setEnabled(state == RUNNING and self.compare is None)

    def show_plan(self) -> None:
        """Before a run: what the profile for this GPU (and model) would choose, and why."""
        if self.controller.active:
            return
        info = self.state.model_info
        profile = info.profile if info is not None and info.profile is not None else self.state.profile
        if profile is None:
            return
        choices = profile.choices()
        for name in SWITCHES:
            choice = choices.get(name)
            text = f"Planned: {choice.reason}" if choice is not None else ""
            if name == "moe_routing" and info is not None and not info.is_moe:
                text = "No — this model has no MoE expert layers"
            self.reasons[name].setText(html.escape(text, quote=False))

    def settings(self, switch: str) -> SpeedConfig:
        """The run's settings with only ``switch`` taken from its control (the others stay as the user left them)."""
        base = self.controller.current_speed()
        if switch in self.on_off:
            return dataclasses.replace(base, **{switch: self.on_off[switch].isChecked()})
        if switch == "checkpointing":
            return dataclasses.replace(base, checkpointing=cast(Checkpointing, self.checkpoint_box.currentText()))
        return dataclasses.replace(base, moe_routing="sync-free" if self.moe_box.isChecked() else "stock")

    def _flip(self, switch: str) -> None:
        if not self._updating and self.controller.active:
            self.controller.request_speed(self.settings(switch))

    def show_state(self, state: dict[str, dict[str, Any]]) -> None:
        """Mirror the engine's resolved choices without sending them back as requests."""
        self._updating = True
        try:
            for name, box in self.on_off.items():
                box.setChecked(bool(state.get(name, {}).get("on")))
            self.checkpoint_box.setCurrentText(str(state.get("checkpointing", {}).get("mode", "none")))
            self.moe_box.setChecked(state.get("moe_routing", {}).get("mode") not in (None, "stock"))
        finally:
            self._updating = False
        for name in SWITCHES:
            idle = nothing_to_do(name, state)
            text = f"No — {idle}" if idle else f"Yes — {state.get(name, {}).get('reason', '')}"
            self.reasons[name].setText(html.escape(text, quote=False))
            if idle:
                self.results[name].setText(f"nothing to do: {html.escape(idle, quote=False)}")

    def on_event(self, event: object) -> None:
        if isinstance(event, SpeedChanged):
            self.show_state(event.state)
            if self.compare is not None:
                self.compare.speed_applied(event.step)
                idle = nothing_to_do(self.compare.switch, event.state)
                if idle and not self.compare.done:  # e.g. offloading asked for on a GPU that shares host memory
                    self.controller.request_speed(self.compare.abandon(idle))
                    self._finish_switch()
        elif isinstance(event, StepMetrics) and self.compare is not None:
            request = self.compare.step_done(event.step, event.tokens_per_s)
            if request is not None:
                self.controller.request_speed(request)
                if self.compare.done:
                    self._finish_switch()
        elif isinstance(event, (RunFinished, RunFailed)) and self.compare is not None:
            self._finish_switch()
            self.queue.clear()

    def start_compare(self) -> None:
        self.queue = list(SWITCHES)
        self.compare_button.setEnabled(False)
        self._next_switch()

    def _next_switch(self) -> None:
        state = self.controller.speed_state
        while self.queue:
            name = self.queue.pop(0)
            idle = nothing_to_do(name, state)
            if idle:
                self.results[name].setText(f"nothing to do: {html.escape(idle, quote=False)}")
                continue
            self.compare = ABCompare(self.controller.current_speed(), name, rounds=self.rounds.value(),
                                     block_steps=self.block.value())  # fmt: skip
            self.compare_status.setText(f"Measuring {TITLES[name]}: {self.compare.steps_needed()} steps…")
            self.results[name].setText("measuring…")
            self.controller.request_speed(self.compare.first_settings())
            return
        self.compare = None
        self.compare_status.setText(
            "Compare done: speedups are on over off, mean ± standard deviation over rounds. "
            "Your own settings are back from the next step."
        )
        self.compare_button.setEnabled(self.controller.state == RUNNING)

    def _finish_switch(self) -> None:
        assert self.compare is not None
        result = self.compare.result
        self.results[result.switch].setText(html.escape(result.summary(), quote=False))
        self.compare = None
        self._next_switch()


def _wrapping_label(text: str) -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    return label
