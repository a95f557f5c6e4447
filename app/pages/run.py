"""Run page: start, pause, resume and stop a run, with live charts, progress, time left and warnings.

Before Start, the summary line says what the plan predicts for the current settings (peak memory, training time on
this machine); during and after the run it is the run's summary (engine.run.summary) that every page shows: state,
measured peak memory beside the plan's prediction, mean speed, and the time left or how close the estimate was.

With a second computer, this one starts the run (node 0) or joins one the other starts (app.widgets.join_run); during
such a run a table shows each computer's devices, step time and memory, and which one is slower
(app.widgets.node_table).

Pause keeps the model loaded (the engine blocks between two steps); resume continues the same run; stop saves
a checkpoint first. Failures arrive as a RunFailed event and are shown as a message with what to do next.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.app_state import AppState
from app.background import run_controller as rc
from app.background.worker import describe_error
from app.pages.export import ExportDialog
from app.pages.recipe import fit_warning
from app.theme import ERROR_COLOR
from app.widgets.fitted_label import FittedLabel
from app.widgets.gpu_selector import GpuSelector
from app.widgets.join_run import JoinRun
from app.widgets.node_table import NodeTable
from app.widgets.notices import NoticeList
from app.widgets.reward_progress import RewardProgress
from app.widgets.run_charts import RunCharts
from app.widgets.second_computer import SecondComputer
from engine.config import RunConfig
from engine.events import (
    BestAdapterKept,
    CheckpointSaved,
    EvalMetrics,
    EvalRising,
    NodeFigures,
    Notice,
    OomRecovered,
    RunFailed,
    RunFinished,
    RunStarted,
    SpeedChanged,
    SpeedRestored,
    StepMetrics,
)
from engine.hardware.recipes import describe_peak
from engine.run.estimate import describe_time, format_duration
from engine.run.registry import RunRecord
from engine.run.summary import describe

SHORT_NAMES = {"metadata_cache": "cache", "cudnn_attention": "cudnn attention", "fused_loss": "fused loss",
               "fused_kernels": "kernels", "lora_16bit": "lora 16-bit", "chunked_mlp": "chunked mlp",
               "host_embedding": "host embedding", "dequant_once": "dequant once",
               "resident_layers": "resident layers", "fp8_base": "fp8 base", "step_graphs": "step graphs"}  # fmt: skip


def speed_label(before: dict[str, dict[str, object]], after: dict[str, dict[str, object]]) -> str:
    """A short label for a tokens/s mark: what changed at that step ("cache off", "ckpt offloaded"); "" if nothing."""
    parts = []
    for key, short in SHORT_NAMES.items():
        if before.get(key, {}).get("on") != after.get(key, {}).get("on"):
            parts.append(f"{short} " + ("on" if after.get(key, {}).get("on") else "off"))
    for key, short in (("checkpointing", "ckpt"), ("moe_routing", "moe")):
        if before.get(key, {}).get("mode") != after.get(key, {}).get("mode"):
            parts.append(f"{short} {after.get(key, {}).get('mode')}")
    return ", ".join(parts)


def _same_folder(first: str, second: str) -> bool:
    return Path(first).resolve() == Path(second).resolve()


class RunPanel(QWidget):
    """Controls, progress and charts of the current run."""

    start_requested = Signal()
    open_report_requested = Signal(str)
    """Open report: the Report page for the run that just ended (its folder)."""

    def __init__(self, state: AppState, controller: rc.RunController, build_config: Callable[[], RunConfig]) -> None:
        super().__init__()
        self.state, self.controller, self.build_config = state, controller, build_config
        self.start_button = QPushButton("Start")
        self.pause_button = QPushButton("Pause")
        self.resume_button = QPushButton("Resume")
        self.stop_button = QPushButton("Stop (saves a checkpoint)")
        self.start_button.clicked.connect(self.start)
        self.pause_button.clicked.connect(controller.pause)
        self.resume_button.clicked.connect(controller.resume)
        self.stop_button.clicked.connect(controller.stop)
        self.export_button = QPushButton("Export…")
        self.export_button.setToolTip("Export the run that just ended: its adapter, a merged model or a GGUF file")
        self.export_button.clicked.connect(self.export_run)
        self.ended_run: str | None = None
        """The folder of the last run that ended with an adapter (what Export… exports)."""
        self.report_status = FittedLabel("", lines=0)
        """Where the before/after report of the run that just ended is: being built, written, or why not."""
        self.open_report_button = QPushButton("Open report")
        self.open_report_button.setToolTip("Base model and tuned side by side on the run's held-out examples")
        self.open_report_button.clicked.connect(lambda: self.open_report_requested.emit(self.ended_run or ""))
        self.open_report_button.hide()
        self.status = FittedLabel("", lines=2)
        self.summary = FittedLabel("", lines=2)
        self.plan = FittedLabel("")
        """Before Start: the plan's predicted peak and how long training takes on this machine."""
        self.summary.setToolTip(
            "Memory measured during the run (GPU memory reserved, or the process's resident memory on a CPU run) "
            "beside the plan's prediction (the training's tensors alone)"
        )
        self.error = FittedLabel("", lines=2)
        self.error.setStyleSheet(f"color:{ERROR_COLOR}; font-weight:bold")
        self.progress = QProgressBar()
        self.eta = QLabel("")
        self.eta.setFixedWidth(120)
        self.charts = RunCharts()
        self.rewards = RewardProgress()
        """A run that learns from rewards: its reward charts and sampled answers (hidden for other runs)."""
        self.gpu_selector = GpuSelector()
        self.second_computer = SecondComputer()
        self.second_computer.toggled.connect(self._show_second_command)
        self.join_run = JoinRun()
        self.join_run.join_requested.connect(self.join)
        self.second_computer.toggled.connect(lambda on: self._one_side(on, self.join_run))
        self.join_run.toggled.connect(lambda on: self._one_side(on, self.second_computer))
        self.nodes = NodeTable()
        self.warnings = NoticeList()
        self.warnings.setMaximumHeight(72)
        self.speed_state: dict[str, dict[str, object]] = {}
        self._layout()
        controller.run_event.connect(self.on_event)
        controller.telemetry.connect(self.on_telemetry)
        controller.state_changed.connect(self._update_buttons)
        state.hardware_changed.connect(lambda: self.gpu_selector.set_hardware(state.hardware))
        self.gpu_selector.changed.connect(self._show_gpu_plan)
        state.run_changed.connect(self.show_summary)
        state.plan_changed.connect(self.show_summary)
        self._update_buttons(controller.state)
        self.show_summary()

    def _layout(self) -> None:
        buttons = QHBoxLayout()
        for button in (self.start_button, self.pause_button, self.resume_button, self.stop_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        after = QHBoxLayout()  # a row of its own: beside the run's buttons, these went past a small window's edge
        after.addWidget(self.report_status, 1)
        after.addWidget(self.open_report_button)
        after.addWidget(self.export_button)
        progress = QHBoxLayout()
        progress.addWidget(self.progress, 1)
        progress.addWidget(self.eta)
        layout = QVBoxLayout(self)
        layout.addWidget(self.gpu_selector)
        layout.addWidget(self.second_computer)
        layout.addWidget(self.join_run)
        layout.addLayout(buttons)
        layout.addLayout(after)
        layout.addWidget(self.plan)
        layout.addWidget(self.status)
        layout.addWidget(self.summary)
        layout.addWidget(self.error)
        layout.addLayout(progress)
        layout.addWidget(self.nodes)
        layout.addWidget(QLabel("<b>Warnings and notices</b>"))
        layout.addWidget(self.warnings)
        layout.addWidget(self.rewards, 1)  # a reward run's own figures first, its loss and memory under them
        layout.addWidget(self.charts, 1)

    def _show_gpu_plan(self) -> None:
        try:
            self.gpu_selector.show_plan(self.build_config())
        except Exception as err:  # an unfinished form: the Start button reports it
            self.gpu_selector.plan.setText(describe_error(err).message)

    def _show_second_command(self, on: bool) -> None:
        try:
            self.second_computer.show_command(self.build_config())
        except Exception as err:  # an unfinished form: the Start button reports it
            self.second_computer.command.setText(describe_error(err).message)

    def start(self) -> None:
        try:
            config = self.second_computer.apply(self.gpu_selector.apply(self.build_config()))
            self.second_computer.stop_check()
        except Exception as err:
            info = describe_error(err)
            self.show_error(info.message, info.hint)
            return
        self._reset_view(config)
        warning = fit_warning(config, self.state.model_info, self.state.hardware, self.state.data_report)
        if warning:  # the user may know better (another card, a smaller dataset): warn, do not refuse
            self._add_warning(warning)
        self.status.setText(f"Loading {config.model.name} and preparing the data…")
        gpus = self.gpu_selector.selected()
        self.charts.set_gpus(tuple(gpus))
        self.state.begin_run()
        self.controller.start(config, gpu_indices=gpus)
        self.start_requested.emit()

    @staticmethod
    def _one_side(on: bool, other: QGroupBox) -> None:
        """This computer starts a run with a second one, or joins one: never both."""
        if on:
            other.setChecked(False)

    def join(self) -> None:
        """Join the run another computer starts, as the command its app shows for this one would."""
        try:
            config = self.join_run.apply(self.build_config())
        except Exception as err:
            info = describe_error(err)
            self.show_error(info.message, info.hint)
            return
        self._reset_view(config)
        self.status.setText(f"Joining the run at {config.training.rendezvous}: waiting for the other computer…")
        self.state.begin_run()
        self.controller.start(config)
        self.start_requested.emit()

    def _reset_view(self, config: RunConfig) -> None:
        self.error.setText("")
        self.warnings.clear()
        self.charts.clear()
        self.rewards.begin(config)
        self.nodes.clear()
        self.nodes.this_node = config.training.node_rank
        self.speed_state = {}
        self.progress.setValue(0)
        self.report_status.setText("")
        self.open_report_button.hide()

    def resume_run(self, folder: str) -> None:
        """Continue a stopped run from its last checkpoint (the Runs page asks for this)."""
        self._start_other(lambda: RunConfig.load(Path(folder) / "config.json"), f"Resuming {folder}…", folder)

    def start_config(self, config: RunConfig) -> None:
        """Start a run another page built (the Chat page's DPO run on the saved preferences)."""
        self._start_other(lambda: config, f"Loading {config.model.name} and preparing the preference pairs…")

    def _start_other(self, load: Callable[[], RunConfig], status: str, resume: str | None = None) -> None:
        """Start a run whose settings come from elsewhere than the Recipe page, as the Start button would."""
        if self.controller.active:
            self.show_error("a run is already going", "stop it first, then start the other one")
            return
        try:  # the run's settings, on the cards ticked now (a run resumes on more or fewer GPUs)
            config = self.gpu_selector.apply(load())
        except Exception as err:
            info = describe_error(err)
            self.show_error(info.message, info.hint)
            return
        self._reset_view(config)
        self.status.setText(status)
        gpus = self.gpu_selector.selected()
        self.charts.set_gpus(tuple(gpus))
        self.state.begin_run()
        self.controller.start(config, resume=resume, gpu_indices=gpus)
        self.start_requested.emit()

    def show_error(self, message: str, hint: str | None) -> None:
        advice = f"<br><span style='font-weight:normal'>What to do: {html.escape(hint)}</span>" if hint else ""
        self.error.setText(html.escape(message) + advice)

    def on_event(self, event: object) -> None:
        self.rewards.on_event(event)
        if isinstance(event, StepMetrics):
            self._on_step(event)
        elif isinstance(event, EvalMetrics):
            self.charts.add_eval(event.step, event.loss)
        elif isinstance(event, NodeFigures):
            self.nodes.show_figures(event)
        elif isinstance(event, RunStarted):
            self.charts.set_device(event.device)
            if event.start_step > 0:
                self.charts.load_history(Path(event.run_dir), event.start_step)
            self.progress.setRange(0, event.total_steps)
            self.progress.setValue(event.start_step)
            self.status.setText(
                f"Training on {event.device} ({event.dtype}): {event.train_examples:,} examples in "
                f"{event.train_rows:,} packed rows ({event.packing_efficiency:.0%} full), "
                f"{event.trainable_params:,} trainable parameters. Folder: {event.run_dir}"
            )
        elif isinstance(event, SpeedChanged):
            label = speed_label(self.speed_state, event.state)
            # a run's first plan (a resumed run's, at its start step too) is where it starts, not a change
            if event.step > 0 and label and self.speed_state:
                self.charts.mark_speed_change(event.step, label)
            self.speed_state = event.state
        elif isinstance(event, Notice):
            self.warnings.add(f"Note: {event.message}")
        elif isinstance(event, OomRecovered):
            self.warnings.add(f"Step {event.step}: {event.message}", warning=True)
        elif isinstance(event, SpeedRestored):
            self.warnings.add(f"Step {event.step}: {event.message}")
        elif isinstance(event, CheckpointSaved):  # one line, updated: not a list growing every few steps
            self.warnings.add(f"Last checkpoint: step {event.step}", key="checkpoint")
        elif isinstance(event, BestAdapterKept):
            text = f"Best adapter so far: step {event.step} (held-out loss {event.eval_loss:.3f}), kept for Chat/Export"
            self.warnings.add(text, key="best")
        elif isinstance(event, EvalRising):
            self.warnings.add(f"Step {event.step}: {event.message}", warning=True)
        elif isinstance(event, RunFinished):
            what = "Stopped" if event.cancelled else "Stopped early" if event.stopped_early else "Finished"
            loss = f", last loss {event.final_loss:.3f}" if event.final_loss is not None else ""
            best = f" Best adapter: step {event.best_step} (used by Chat and Export)." if event.best_step else ""
            self.status.setText(f"{what} at step {event.step}{loss}. Adapter: {event.adapter_dir}.{best}")
            self.ended_run = event.run_dir if Path(event.adapter_dir, "adapter_config.json").exists() else None
            self.export_button.setEnabled(self.ended_run is not None and not self.controller.active)
            self.eta.setText("")
        elif isinstance(event, RunFailed):
            self.show_error(event.message, event.hint)
            self.status.setText(f"The run stopped at step {event.step}.")

    def show_readiness(self, text: str) -> None:
        """Before the first run, what the guide bar says is next (a step missing, or all ready): never a stale
        "choose a model" once everything is chosen. After a run, its own status stays."""
        if text and self.controller.state == rc.IDLE:
            self.status.setText(text)

    def follow_history(self, records: list[RunRecord]) -> None:
        """The run list changed: a run that ended here and is gone from it (deleted) has nothing left to open."""
        if self.ended_run is None or any(_same_folder(record.folder, self.ended_run) for record in records):
            return
        name = Path(self.ended_run).name
        self.ended_run = None
        self.open_report_button.hide()
        self.export_button.setEnabled(False)
        self.report_status.setText("")
        if not self.controller.active:
            self.status.setText(f"The run that ended here ({name}) was deleted on the Runs page.")

    def report_building(self, folder: str) -> None:
        """The before/after report of ``folder`` is being measured (said only for the run that just ended here)."""
        if folder == self.ended_run:
            self.report_status.setText("Building the before/after report…")
            self.open_report_button.hide()

    def report_ready(self, folder: str) -> None:
        if folder == self.ended_run:
            self.report_status.setText(f"Before/after report: {Path(folder, 'report.md')}")
            self.open_report_button.show()

    def report_failed(self, folder: str, note: str) -> None:
        if folder == self.ended_run:
            self.report_status.setText(f"No before/after report: {note}")

    def _on_step(self, event: StepMetrics) -> None:
        self.charts.add_step(event.step, event.loss, event.tokens_per_s)
        self.charts.add_step_peak(event.memory_bytes)
        self.progress.setValue(event.step)
        reward = f" · reward {event.reward_mean:.3f}" if event.reward_mean is not None else ""
        self.progress.setFormat(f"step %v of %m · loss {event.loss:.3f}{reward}")

    def show_summary(self) -> None:
        """The run's summary as every page words it, and while no run goes, the plan for the current settings."""
        run = self.state.run
        self.summary.setText("" if run.state == "idle" else describe(run).line())
        left = run.estimate.left_s if run.estimate is not None and run.active else None
        self.eta.setText(f"{format_duration(left)} left" if left is not None else "")
        figure, time = self.state.planned_figure, self.state.planned_time
        peak = describe_peak(figure) if figure is not None and figure.fits else ""
        recipe = f" ({self.state.planned_recipe} recipe)" if peak and self.state.planned_recipe else ""
        parts = [f"predicted peak memory {peak}{recipe}" if peak else "",
                 describe_time(time, None, None, False) if time is not None else ""]  # fmt: skip
        shown = " · ".join(part for part in parts if part)
        self.plan.setText(f"Plan for the next run: {shown}" if shown and not run.active else "")

    def on_telemetry(self, event: object) -> None:
        from engine.hardware.telemetry import TelemetrySample, TelemetryWarning

        if isinstance(event, TelemetryWarning):
            self._add_warning(event.message)
        elif isinstance(event, TelemetrySample):
            host = self.state.hardware.host_memory_bytes if self.state.hardware is not None else None
            self.charts.add_sample(event, host)

    def export_run(self) -> None:
        """The export dialog for the run that just ended (the Runs page exports any other)."""
        if self.ended_run is not None:
            self.export_dialog = ExportDialog(self.ended_run, Path(self.ended_run).name, self)
            self.export_dialog.open()

    def _add_warning(self, message: str) -> None:
        self.warnings.add(message, warning=True)

    def _update_buttons(self, state: str) -> None:
        self.start_button.setEnabled(not self.controller.active)
        self.join_run.join_button.setEnabled(not self.controller.active)
        joined = self.nodes.this_node != 0  # pause comes from the computer that started the run
        self.pause_button.setEnabled(state == rc.RUNNING and not joined)
        self.resume_button.setEnabled(state == rc.PAUSED)
        self.stop_button.setEnabled(state in (rc.LOADING, rc.RUNNING, rc.PAUSED))
        self.export_button.setEnabled(not self.controller.active and self.ended_run is not None)
        if state == rc.PAUSED:
            self.status.setText("Paused: the model stays loaded; Resume continues the same run.")
        elif state == rc.RUNNING and self.status.text().startswith("Paused"):
            self.status.setText("Running again: the same run continues from where it paused.")
        elif state == rc.STOPPING:
            self.status.setText("Stopping after this step and saving a checkpoint…")
