"""GPU setup page: which torch build fits this machine, and installing or repairing it with live progress.

TuneDeck ships without torch because the right CUDA build depends on the GPU and driver (engine.setup.torch_build).
This page opens first when torch is missing, so nothing here may import torch: it only asks ``find_spec``. The
install and repair jobs are the engine's event generators (engine.setup.environment); a QThread iterates them and
re-emits each event, so the progress bar and the log fill as uv works, and Cancel stops uv's process group.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable

from PySide6.QtCore import QObject, QThread, Signal
from PySide6.QtWidgets import (
    QComboBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.background.worker import ErrorInfo, TaskRunner, describe_error
from engine.setup import environment
from engine.setup.cancel import CancelToken
from engine.setup.environment import BASE_INSTALL_BYTES, InstallLayout
from engine.setup.events import (
    OutputLine,
    Progress,
    SetupCancelled,
    SetupEvent,
    SetupFailed,
    SetupFinished,
    SetupWarning,
    StepStarted,
)
from engine.setup.torch_build import BUILDS, DriverInfo, TorchChoice, choose_torch_build, detect_driver

Job = Callable[..., Iterable[SetupEvent]]
"""``job(layout, choice, wheelhouse=None, cancel=token)``: environment.install_torch or environment.repair."""

STEPS = 1000  # progress bar resolution: stages and packages within a stage share one bar


def torch_missing() -> bool:
    """True when torch is not installed; looks it up without importing it (that takes seconds and may crash)."""
    importlib.invalidate_caches()  # a torch installed while the app runs must be seen
    return importlib.util.find_spec("torch") is None


class SetupJobWorker(QThread):
    """Iterates one setup job in its own thread and emits each event; ``cancel`` stops it between uv's lines."""

    setup_event = Signal(object)

    def __init__(self, job: Job, layout: InstallLayout, choice: TorchChoice, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.job, self.install_layout, self.choice = job, layout, choice
        self.cancel_token = CancelToken()

    def run(self) -> None:
        try:
            for event in self.job(self.install_layout, self.choice, wheelhouse=None, cancel=self.cancel_token):
                self.setup_event.emit(event)
        except Exception as err:  # uv missing, a full disk: say so in the page instead of losing the thread
            info = describe_error(err)
            self.setup_event.emit(SetupFailed(info.message, info.hint or ""))


def overall_progress(step: tuple[int, int], done: int, total: int) -> int:
    """Stages split the bar evenly; packages done within the current stage fill its share."""
    index, count = step
    within = done / total if total > 0 else 0.0
    return round(STEPS * (max(index - 1, 0) + min(within, 1.0)) / max(count, 1))


def gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB"


class SetupView(QWidget):
    """The detected GPU and driver, the chosen build, disk space, and Install / Cancel / Repair."""

    installed = Signal()  # an install or repair finished: pages that need torch can look again
    job_ended = Signal()  # the job's thread is gone and the buttons show it

    def __init__(
        self,
        tasks: TaskRunner,
        layout: InstallLayout | None = None,
        detect: Callable[[], DriverInfo] = detect_driver,
        install_job: Job = environment.install_torch,
        repair_job: Job = environment.repair,
    ) -> None:
        super().__init__()
        self.tasks, self.detect_job = tasks, detect
        self.install_layout = layout if layout is not None else environment.current_layout()
        self.jobs = {"install": install_job, "repair": repair_job}
        self.driver: DriverInfo | None = None
        self.worker: SetupJobWorker | None = None
        self.step = (1, 1)
        self._build_ui()
        self._update_buttons()

    def _build_ui(self) -> None:
        self.status = QLabel(self._status_text())
        self.warnings, self.stage, self.result = QLabel(""), QLabel(""), QLabel("")
        for label in (self.status, self.warnings, self.result):
            label.setWordWrap(True)
        for empty in (self.warnings, self.stage, self.result):
            empty.hide()  # shown when they have something to say: no blank gaps
        page = QVBoxLayout(self)
        page.addWidget(self.status)
        page.addLayout(self._detection_form())
        for part in (self.warnings, self.stage):
            page.addWidget(part)
        self._add_job_area(page)

    def _detection_form(self) -> QFormLayout:
        """GPU, driver, build (with a manual choice), why, disk space and where it goes."""
        folder = str(self.install_layout.root) if self.install_layout else "not an installation (developer checkout)"
        self.gpu_label, self.driver_label = QLabel("Detecting…"), QLabel("…")
        self.reason_label, self.space_label, self.folder_label = QLabel(""), QLabel(""), QLabel(folder)
        self.build_box = QComboBox()
        self.build_box.addItem("Automatic", None)
        for build in BUILDS:
            self.build_box.addItem(build, build)
        self.build_box.setMaximumWidth(260)
        self.build_box.currentIndexChanged.connect(self._show_choice)
        form = QFormLayout()
        rows: list[tuple[str, QWidget]] = [("GPU", self.gpu_label), ("Driver", self.driver_label)]
        rows += [("torch build", self.build_box), ("Why", self.reason_label), ("Disk space", self.space_label)]
        rows.append(("Installed in", self.folder_label))
        for name, widget in rows:
            if isinstance(widget, QLabel):
                widget.setWordWrap(True)  # long install paths wrap instead of widening the window
            form.addRow(name, widget)
        return form

    def _add_job_area(self, page: QVBoxLayout) -> None:
        """Progress bar, Install / Cancel / Repair, the outcome, and uv's log."""
        self.progress = QProgressBar()
        self.progress.setRange(0, STEPS)
        self.progress.setValue(0)
        self.install_button, self.cancel_button = QPushButton("Install torch"), QPushButton("Cancel")
        self.repair_button = QPushButton("Repair environment")
        self.repair_button.setToolTip("Rebuild the whole environment beside the old one and swap it in when it works")
        self.install_button.clicked.connect(lambda: self.start_job("install"))
        self.repair_button.clicked.connect(lambda: self.start_job("repair"))
        self.cancel_button.clicked.connect(self.cancel)
        buttons = QHBoxLayout()
        for button in (self.install_button, self.cancel_button, self.repair_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(5000)
        self.log.setPlaceholderText("uv's output appears here during an install or repair.")
        page.addWidget(self.progress)
        page.addLayout(buttons)
        page.addWidget(self.result)
        page.addWidget(self.log, 1)

    def _status_text(self) -> str:
        if self.install_layout is None:
            return ("This is a developer checkout, not an installed TuneDeck: install torch into it with uv or pip. "
                    "The detection below still shows which build fits.")  # fmt: skip
        if torch_missing():
            return "torch is not installed yet. TuneDeck needs it to train: install the build that fits your GPU."
        return "torch is installed. If TuneDeck stopped working after an update or a crash, repair the environment."

    # ---------------------------------------------------------------------------------------------- detection

    def refresh(self) -> None:
        """Detect the driver in the background: NVML is instant, but the nvidia-smi fallback may take seconds."""
        self.gpu_label.setText("Detecting…")
        self.tasks.start(self.detect_job, self.show_driver, self._detection_failed)

    def show_driver(self, driver: DriverInfo) -> None:
        self.driver = driver
        gpus = [f"{gpu.name} ({gpu.sm})" for gpu in driver.gpus]
        self.gpu_label.setText(", ".join(gpus) or "no NVIDIA GPU found")  # why not: in the choice's reason
        cuda = "{}.{}".format(*driver.cuda_version) if driver.cuda_version else "unknown"
        self.driver_label.setText(
            f"{driver.driver_version or 'unknown'}, supports CUDA {cuda}" if driver.source != "none" else "none"
        )
        self._show_choice()

    def _detection_failed(self, error: ErrorInfo) -> None:
        self.show_driver(DriverInfo(None, None, (), "none", error.message))

    def choice(self) -> TorchChoice | None:
        if self.driver is None:
            return None
        return choose_torch_build(self.driver, self.build_box.currentData())

    def _show_choice(self) -> None:
        choice = self.choice()
        if choice is None:
            return
        automatic = choose_torch_build(self.driver)  # type: ignore[arg-type]
        self.build_box.setItemText(
            0, "Automatic (update the driver)" if automatic.blocked else f"Automatic ({automatic.build})"
        )
        self.reason_label.setText(choice.reason)
        lines = [f"⚠ {text}" for text in choice.warnings]
        if choice.blocked and not choice.overridden:
            lines.append("Install is off until the driver is updated, or pick the cpu build above to go on without it.")
        self.warnings.setText("\n".join(lines))
        self.warnings.setVisible(bool(lines))
        self.warnings.setStyleSheet("color: #b00020;" if choice.blocked else "color: #a15c00;")
        self._show_space(choice)
        self._update_buttons()

    def _show_space(self, choice: TorchChoice) -> None:
        if self.install_layout is None:
            self.space_label.setText(f"about {gb(choice.installed_bytes)} ({gb(choice.download_bytes)} download)")
            return
        free = environment.free_bytes(self.install_layout.root)
        text = (f"about {gb(choice.installed_bytes)} ({gb(choice.download_bytes)} download; a repair needs "
                f"{gb(choice.installed_bytes + BASE_INSTALL_BYTES)}); {gb(free)} free on this drive")  # fmt: skip
        self.space_label.setText(text)
        self.space_label.setStyleSheet("color: #b00020;" if free < choice.installed_bytes else "")

    # --------------------------------------------------------------------------------------------------- jobs

    def running(self) -> bool:
        return self.worker is not None and self.worker.isRunning()

    def _update_buttons(self) -> None:
        choice, busy = self.choice(), self.running()
        usable = self.install_layout is not None and choice is not None and not busy
        self.install_button.setEnabled(usable and not (choice.blocked and not choice.overridden))  # type: ignore[union-attr]
        self.repair_button.setEnabled(usable and not (choice.blocked and not choice.overridden))  # type: ignore[union-attr]
        self.cancel_button.setEnabled(busy)
        self.build_box.setEnabled(not busy)

    def start_job(self, name: str) -> None:
        """Start ``install`` or ``repair`` with the build shown; events arrive through :meth:`show_event`."""
        choice = self.choice()
        if self.install_layout is None or choice is None or self.running():
            return
        self.log.clear()
        self.result.setText("")
        self.result.hide()
        self.progress.setValue(0)
        self.step = (1, 1)
        self.worker = SetupJobWorker(self.jobs[name], self.install_layout, choice, self)
        self.worker.setup_event.connect(self.show_event)
        self.worker.finished.connect(self._job_ended)
        self.worker.start()
        self._update_buttons()

    def _job_ended(self) -> None:
        if not self.result.text():  # a job that stopped without a last word: cancelled, else it just ended
            cancelled = self.worker is not None and self.worker.cancel_token.cancelled
            self._finish("Cancelled." if cancelled else "The job ended without a result; see the log.", "#a15c00")
        self._update_buttons()
        self.job_ended.emit()

    def cancel(self) -> None:
        if self.running():
            self.worker.cancel_token.cancel()  # type: ignore[union-attr]
            self._set_stage("Cancelling…")

    def shutdown(self) -> None:
        """On close: stop uv and wait for the thread, so no process outlives the window."""
        if self.worker is not None:
            self.worker.cancel_token.cancel()
            self.worker.wait(30_000)

    def show_event(self, event: SetupEvent) -> None:
        if isinstance(event, StepStarted):
            self.step = (event.index, event.total)
            self._set_stage(f"Step {event.index} of {event.total}: {event.title}")
            self.progress.setValue(overall_progress(self.step, 0, 0))
            self.log.appendPlainText(f"== {event.title}")
        elif isinstance(event, Progress):
            self.progress.setValue(overall_progress(self.step, event.done, event.total))
            if event.total:
                counted = f"{event.done} of {event.total} {event.item}".rstrip()
                self._set_stage(f"{self.stage.text().split(' — ')[0]} — {counted}")
        elif isinstance(event, OutputLine):
            self.log.appendPlainText(event.text)
        else:
            self._show_outcome(event)

    def _show_outcome(self, event: SetupEvent) -> None:
        if isinstance(event, SetupWarning):
            self.log.appendPlainText(f"warning: {event.text}")
        elif isinstance(event, SetupFinished):
            self.progress.setValue(STEPS)
            restart = " Restart TuneDeck to use it." if event.restart_needed or torch_missing() else ""
            self._finish(f"✔ {event.summary}.{restart}", "#1b7f3b")
            self.installed.emit()
        elif isinstance(event, SetupFailed):
            self._finish(f"✘ {event.message}" + (f"\n{event.hint}" if event.hint else ""), "#b00020")
        elif isinstance(event, SetupCancelled):
            self._finish(f"Cancelled: {event.message}", "#a15c00")

    def _set_stage(self, text: str) -> None:
        self.stage.setText(text)
        self.stage.setVisible(bool(text))  # no blank line above the bar between jobs

    def _finish(self, text: str, color: str) -> None:
        self._set_stage("")
        self.result.setText(text)
        self.result.show()
        self.result.setStyleSheet(f"color: {color};")
        self.status.setText(self._status_text())
