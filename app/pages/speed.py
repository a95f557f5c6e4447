"""Speed page: the speed optimizations, live. Each says whether it is on here and why; flipping one takes
effect at the next step (the tokens/s chart marks it). Compare measures each one on the running job, and "All on
vs all off" measures them together; the results are drawn as bars with their spread.
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

from app.app_state import AppState
from app.background.ab_compare import (
    ALL,
    ON_OFF_SWITCHES,
    SWITCHES,
    TITLES,
    ABCompare,
    Measurement,
    nothing_to_do,
    switch_settings,
)
from app.background.run_controller import LOADING, RUNNING, RunController
from app.widgets.compare_chart import CompareChart
from app.widgets.switch_words import describe_plan, describe_state
from engine.config import SpeedConfig
from engine.events import RunFailed, RunFinished, RunStarted, SpeedChanged, StepMetrics

CHECKPOINT_MODES = ("none", "standard", "offloaded")
PLANNED_AT_START = "Decided when the run starts, from the model and the machine it trains on"
SHORT_TITLES = {
    ALL: "all on vs all off",
    "metadata_cache": "metadata cache",
    "fused_loss": "fused loss",
    "lora_16bit": "LoRA in 16-bit",
    "fused_kernels": "fused kernels",
    "checkpointing": "offloaded ckpt",
    "chunked_mlp": "chunked MLP",
    "host_embedding": "host embedding",
    "dequant_once": "dequant once",
    "resident_layers": "resident layers",
    "fp8_base": "fp8 base",
    "step_graphs": "step graphs",
    "moe_routing": "MoE routing",
}
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
        self.compare_button = QPushButton("Compare each switch")
        self.compare_button.setToolTip("Measure each switch on this run: on and off for a few steps per round")
        self.compare_button.clicked.connect(lambda: self.start_compare())
        self.all_button = QPushButton("All on vs all off")
        self.all_button.setToolTip(
            "TuneDeck's speed switches as chosen for this machine against all of them off (stock transformers and "
            "peft). Memory savers (checkpointing, chunked MLP, host embedding) stay as they are."
        )
        self.all_button.clicked.connect(lambda: self.start_compare([ALL]))
        self.compare_status = _wrapping_label("Compare alternates a switch on and off for a few steps per round.")
        self.chart = CompareChart()
        self.measured: dict[str, Measurement] = {}
        self.device = ""
        """The run's torch device ("cpu", "cuda:0"): what can apply on it."""
        self.own_speed: SpeedConfig | None = None
        """The user's speed settings when Compare started: a switch they left automatic that the engine reports as
        switched was switched by Compare, and the page says so."""
        self._build()
        self._updating = False
        for name, box in self.on_off.items():
            box.toggled.connect(lambda _=False, name=name: self._flip(name))
        self.moe_box.toggled.connect(lambda _: self._flip("moe_routing"))
        self.checkpoint_box.currentTextChanged.connect(lambda _: self._flip("checkpointing"))
        self.queue: list[str] = []
        self.batch: list[str] = []
        self.compare: ABCompare | None = None
        controller.run_event.connect(self.on_event)
        controller.state_changed.connect(self._state_changed)
        state.hardware_changed.connect(self.show_plan)
        state.model_changed.connect(self.show_plan)
        self._state_changed(controller.state)

    def _build(self) -> None:
        grid = QGridLayout()
        for column, title in enumerate(("Optimization", "Switch", "On here? Why", "Measured")):
            grid.addWidget(QLabel(f"<b>{title}</b>"), 0, column)
        for row, name in enumerate(SWITCHES, start=1):
            grid.addWidget(QLabel(TITLES[name]), row, 0)
            grid.addWidget(self.controls[name], row, 1)
            grid.addWidget(self.reasons[name], row, 2)
            grid.addWidget(self.results[name], row, 3)
        grid.setColumnStretch(2, 4)
        grid.setColumnStretch(3, 1)
        compare = QHBoxLayout()
        for widget in (self.compare_button, self.all_button, QLabel("rounds"), self.rounds, QLabel("steps per block"),
                       self.block):  # fmt: skip
            compare.addWidget(widget)
        compare.addStretch(1)
        layout = QVBoxLayout(self)
        layout.addWidget(_wrapping_label("Flip a switch during a run: it applies from the next step, and the "
                                         "tokens/s chart on the Run page marks the moment."))  # fmt: skip
        layout.addLayout(grid)
        layout.addLayout(compare)
        layout.addWidget(self.compare_status)
        layout.addWidget(self.chart, 1)

    def _state_changed(self, state: str) -> None:
        """Switches work on a live run only; before one, the Setup page's speed settings apply."""
        for control in self.controls.values():
            control.setEnabled(self.controller.active)
        for button in (self.compare_button, self.all_button):
            button.setEnabled(state == RUNNING and self.compare is None)
        if state == LOADING:  # a new run: the last run's measurements no longer apply
            self.measured.clear()
            self.own_speed = None
            self.chart.show_results([])
            for label in self.results.values():
                label.setText("")
                label.setToolTip("")

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
            text = describe_plan(name, choice.value, choice.reason) if choice is not None else PLANNED_AT_START
            if name == "moe_routing" and info is not None and not info.is_moe:
                text = "Not here — this model has no MoE expert layers"
            self.reasons[name].setText(html.escape(text, quote=False))

    def settings(self, switch: str) -> SpeedConfig:
        """The run's settings with only ``switch`` taken from its control (the others stay as the user left them)."""
        base = self.controller.current_speed()
        if switch in self.on_off:
            return switch_settings(base, switch, self.on_off[switch].isChecked())
        if switch == "checkpointing":
            return dataclasses.replace(base, checkpointing=cast(Checkpointing, self.checkpoint_box.currentText()))
        return dataclasses.replace(base, moe_routing="sync-free" if self.moe_box.isChecked() else "stock")

    def _flip(self, switch: str) -> None:
        if not self._updating and self.controller.active:
            if self.compare is None:
                self.own_speed = None  # the switches are the user's again
            self.controller.request_speed(self.settings(switch))

    def _flipper(self, switch: str) -> str:
        """Who flipped ``switch`` where the engine says it was switched: the user, or Compare measuring it."""
        if self.own_speed is None:
            return "you"
        return "Compare" if getattr(self.own_speed, switch, None) in (None, "auto") else "you"

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
            idle = nothing_to_do(name, state, self.device)
            text = describe_state(name, state.get(name, {}), idle, self._flipper(name))
            self.reasons[name].setText(html.escape(text, quote=False))
            if idle and name not in self.measured:
                self.results[name].setText(Measurement(name, skipped_reason=idle).short())

    def on_event(self, event: object) -> None:
        if isinstance(event, RunStarted):
            self.device = event.device
        elif isinstance(event, SpeedChanged):
            self.show_state(event.state)
            if self.compare is not None:
                self.compare.speed_applied(event.step)
                idle = nothing_to_do(self.compare.switch, event.state, self.device)
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
            self._run_ended_during_compare()

    def start_compare(self, switches: list[str] | None = None) -> None:
        """Measure ``switches`` one after the other (every switch by default; ``[ALL]`` for all on vs all off)."""
        self.queue = list(SWITCHES) if switches is None else list(switches)
        self.batch = list(self.queue)
        self.own_speed = self.controller.current_speed()
        for button in (self.compare_button, self.all_button):
            button.setEnabled(False)
        self._next_switch()

    def _next_switch(self) -> None:
        state = self.controller.speed_state
        while self.queue:
            name = self.queue.pop(0)
            idle = nothing_to_do(name, state, self.device)
            if idle:
                self._show_result(Measurement(name, skipped_reason=idle))
                continue
            self.compare = ABCompare(self.controller.current_speed(), name, rounds=self.rounds.value(),
                                     block_steps=self.block.value())  # fmt: skip
            self.compare_status.setText(f"Measuring {TITLES[name]}: {self.compare.steps_needed()} steps…")
            if name in self.results:
                self.results[name].setText("measuring…")
            self.controller.request_speed(self.compare.first_settings())
            return
        self.compare = None
        together = self.measured.get(ALL) if self.batch == [ALL] else None
        lead = f"{TITLES[ALL]}: {together.summary()}. " if together is not None else "Compare done: "
        self.compare_status.setText(
            f"{lead}Speed-ups are on over off, mean ± standard deviation over rounds (a whisker that crosses "
            "zero is within the noise). Your own settings are back from the next step."
        )
        self._state_changed(self.controller.state)

    def _run_ended_during_compare(self) -> None:
        """The run ended first: what was measured stays, the rest is said, and nothing more is asked of the run."""
        current = self.compare
        assert current is not None
        rounds = len(current.result.ratios)  # a switch cut short keeps the rounds it finished, and says so
        left = [*([] if rounds else [current.switch]), *self.queue]
        self.queue.clear()
        self._finish_switch()
        parts = [f"{TITLES.get(current.switch, current.switch)} measured over {rounds} of {current.rounds} "
                 f"round{'s' if current.rounds > 1 else ''}" if rounds else "",
                 f"{', '.join(TITLES.get(name, name) for name in left)} not measured" if left else ""]  # fmt: skip
        self.compare_status.setText(
            f"The run ended before Compare finished: {'; '.join(part for part in parts if part)}. A longer run "
            "(more steps) leaves room to measure every switch."
        )

    def _finish_switch(self) -> None:
        assert self.compare is not None
        self._show_result(self.compare.result)
        self.compare = None
        self._next_switch()

    def _show_result(self, result: Measurement) -> None:
        """A few words in the table (the full sentence as its tooltip) and the bar on the chart."""
        self.measured[result.switch] = result
        if result.switch in self.results:
            self.results[result.switch].setText(html.escape(result.short(), quote=False))
            self.results[result.switch].setToolTip(result.summary())
        order = [ALL, *SWITCHES]
        rows = sorted(self.measured.values(), key=lambda m: order.index(m.switch))
        self.chart.show_results([(SHORT_TITLES.get(m.switch, m.switch), m) for m in rows])


def _wrapping_label(text: str) -> QLabel:
    label = QLabel(text)
    label.setWordWrap(True)
    return label
