"""Model page: a gallery of popular models (and the demo), a GGUF model already on this computer (Ollama, LM
Studio, a .gguf file), a local folder or a hub id, and what the planner says about the chosen one on this GPU.

A gallery model other than the demo is a hub id: choosing it reads only its shape (built in, nothing is
downloaded); its weights are downloaded when the run starts, and the page says how much. A GGUF model is
converted once into a Hugging Face folder when it is chosen, with progress, and the page says what was
dequantized from what.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QFileDialog,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QRadioButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.app_state import AppState
from app.background.worker import ErrorInfo, TaskRunner
from app.pages.hardware import SETTING_NAMES
from app.widgets.local_models import LocalModels, convert_for_this_computer
from app.widgets.model_gallery import ModelGallery, format_size
from app.widgets.model_words import (
    format_params,
    longest_row_html,
    memory_html,
    plan_notes_html,
    resident_layers_html,
    verdict_target,
)
from engine.config import DEMO_MODEL
from engine.hardware.recipes import describe_peak
from engine.model.hub import OFFLINE_MODE, download_model, tokenizer_missing
from engine.model.info import ModelInfo, inspect_model
from engine.model.local_sources import is_local_gguf_name

VERDICT_COLOURS = {"fits": "#1b7f3b", "needs QLoRA": "#b26a00", "too big": "#b00020"}


class ModelPanel(QWidget):
    """Pick a model; shows family, parameters, dense/MoE and the planner's verdict with its settings."""

    changed = Signal()
    """The step's status changed (the guide bar listens)."""

    def __init__(self, state: AppState, tasks: TaskRunner) -> None:
        super().__init__()
        self.state, self.tasks = state, tasks
        self.problem = ""
        """Why the last model could not be used ('' when none failed)."""
        self.from_gallery = QRadioButton("From the gallery (double-click a row to use it)")
        self.on_disk = QRadioButton("A GGUF model on this computer (Ollama, LM Studio or a .gguf file)")
        self.folder = QRadioButton("Local folder")
        self.hub = QRadioButton("Hugging Face hub id")
        self.group = QButtonGroup(self)
        for button in (self.from_gallery, self.on_disk, self.folder, self.hub):
            self.group.addButton(button)
        self.from_gallery.setChecked(True)
        self.gallery = ModelGallery(tasks)
        self.gallery.table.itemSelectionChanged.connect(lambda: self.from_gallery.setChecked(True))
        self.gallery.picked.connect(self.choose)
        self.local = LocalModels(tasks)
        self.local.hide()
        self.local.table.itemSelectionChanged.connect(lambda: self.on_disk.setChecked(True))
        self.local.picked.connect(self._choose_on_disk)
        self.on_disk.toggled.connect(self._show_on_disk)
        self.missing: dict[str, str] = {}
        """Gallery model -> why its tokenizer cannot be read here ("" when it can): the page says so, not a download."""
        self.conversions: dict[str, str] = {}
        """GGUF model name -> what its conversion said (what was dequantized from what)."""
        self.folder_edit = QLineEdit(placeholderText="a folder with config.json and *.safetensors")
        self.folder_edit.textEdited.connect(lambda _: self.folder.setChecked(True))
        self.browse = QPushButton("Browse…")
        self.browse.clicked.connect(self._browse)
        self.hub_edit = QLineEdit(placeholderText="e.g. Qwen/Qwen3-0.6B (downloaded now, with progress)")
        self.hub_edit.textEdited.connect(lambda _: self.hub.setChecked(True))
        self.use = QPushButton("Use this model")
        self.use.clicked.connect(self.choose)
        self.status = QLabel("")
        self.status.setWordWrap(True)
        self.download = QProgressBar()
        self.download.hide()
        self.plan = QLabel("")
        """The chosen recipe's predicted peak: the figure the Recipe and Run pages show."""
        self.plan.setWordWrap(True)
        self.details = QTextBrowser()
        self.details.setMinimumHeight(150)
        layout = QVBoxLayout(self)
        layout.addWidget(self.from_gallery)
        layout.addWidget(self.gallery)
        layout.addWidget(self.on_disk)
        layout.addWidget(self.local)
        grid = QGridLayout()
        grid.addWidget(self.folder, 1, 0)
        grid.addWidget(self.folder_edit, 1, 1)
        grid.addWidget(self.browse, 1, 2)
        grid.addWidget(self.hub, 2, 0)
        grid.addWidget(self.hub_edit, 2, 1, 1, 2)
        layout.addLayout(grid)
        row = QHBoxLayout()
        row.addWidget(self.use)
        row.addWidget(self.status, 1)
        layout.addLayout(row)
        layout.addWidget(self.download)
        layout.addWidget(self.plan)
        layout.addWidget(self.details, 2)
        state.hardware_changed.connect(self._replan)
        state.hardware_changed.connect(lambda: self.gallery.set_hardware(state.hardware))
        state.plan_changed.connect(self._show_plan)
        state.data_changed.connect(self._data_read)
        state.model_changed.connect(self._show_plan)

    def selected_name(self) -> str:
        if self.on_disk.isChecked():
            return self.local.selected_name() or ""
        if self.folder.isChecked():
            return self.folder_edit.text().strip()
        if self.hub.isChecked():
            return self.hub_edit.text().strip()
        return self.gallery.selected_hub_id() or DEMO_MODEL

    def choose(self, name: str | None = None) -> None:
        """Inspect the model in the background; the page and the shared state update when it is done."""
        name = name or self.selected_name()
        if self.gallery.row_for(name) is not None and not self.hub.isChecked():  # a typed hub id downloads now
            self.from_gallery.setChecked(True)
            self.gallery.select(name)
        if not name:
            self.status.setText("Pick a model, or give a folder or a hub id first.")
            return
        self.status.setText(f"Reading {name}…")
        self.problem = ""
        self.state.set_model(name, None)
        self.changed.emit()
        if self.hub.isChecked() and name == self.hub_edit.text().strip():
            self.download.setValue(0)
            self.download.show()
            self.tasks.start(lambda report: download_model(name, report), lambda _: self._inspect(name),
                             self._show_error, on_progress=self._show_progress)  # fmt: skip
        elif is_local_gguf_name(name):
            self._convert(name)
        else:
            self._inspect(name)

    def _show_on_disk(self, checked: bool) -> None:
        self.local.setVisible(checked)
        if checked and not self.local.models:
            self.local.refresh()

    def _choose_on_disk(self, name: str) -> None:
        self.on_disk.setChecked(True)
        self.choose(name)

    def _convert(self, name: str) -> None:
        """A GGUF model becomes a Hugging Face folder once (at once when it was converted before)."""
        self.status.setText(f"Converting {name}…")
        self.download.setValue(0)
        self.download.show()
        self.tasks.start(
            lambda report: convert_for_this_computer(name, report),
            lambda done: self._converted(name, done),
            self._show_error,
            on_progress=self._show_conversion,
        )

    def _converted(self, name: str, conversion: object) -> None:
        self.conversions[name] = str(getattr(conversion, "message", lambda: "")())
        self._inspect(name)

    def _show_conversion(self, what: str, done: float, total: float | None) -> None:
        if total:
            self.download.setRange(0, 1000)
            self.download.setValue(int(1000 * done / total))
        else:
            self.download.setRange(0, 0)
        amount = f" {done:.0f} of {total:.0f} tensors" if total and what.startswith("dequantizing") else ""
        self.status.setText(f"Converting {self.state.model_name}: {what}{amount}")

    def _inspect(self, name: str) -> None:
        self.download.hide()
        hardware = self.state.hardware
        self.tasks.start(lambda: self._read(name, hardware), self._show, self._show_error)

    def _read(self, name: str, hardware: object) -> ModelInfo:
        """The model's facts and, for a gallery model from the hub, what of it is missing here (background thread:
        a lookup on disk)."""
        if self.gallery.row_for(name) is not None and name != DEMO_MODEL:
            self.missing[name] = tokenizer_missing(name)
        return inspect_model(name, hardware)

    def _show_progress(self, what: str, done: float, total: float | None) -> None:
        """Byte counts for file downloads, file counts for the whole repository."""
        if total:
            self.download.setRange(0, 1000)
            self.download.setValue(int(1000 * done / total))
        else:
            self.download.setRange(0, 0)  # busy, size unknown
        amount = f"{done / 2**20:,.0f} of {total / 2**20:,.0f} MiB" if total and total > 1e5 else f"{done:.0f}"
        self.status.setText(f"Downloading {self.state.model_name}: {what} {amount}")

    def _replan(self) -> None:
        if self.state.model_info is not None:
            self._inspect(self.state.model_name)  # planned again for the new hardware: nothing is fetched again
        elif self.state.model_name == DEMO_MODEL:
            self.choose(DEMO_MODEL)

    def _browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Model folder")
        if folder:
            self.folder.setChecked(True)
            self.folder_edit.setText(folder)

    def _show(self, info: ModelInfo) -> None:
        if info.name != self.state.model_name:
            return  # the user picked another model meanwhile
        colour = VERDICT_COLOURS.get(info.verdict, "#444")
        self._show_status(info)
        rows = "".join(
            f"<tr><td><b>{SETTING_NAMES.get(key, key)}</b></td><td>{value}</td><td>{why}</td></tr>"
            for key, (value, why) in info.settings.items()
        )
        converted = self.conversions.get(info.name)
        self.details.setHtml(
            (f"<p>From GGUF: {converted}</p>" if converted else "")
            + f"<p>Family: <b>{info.family}</b> · {format_params(info.total_params)} parameters · "
            f"{'mixture of experts' if info.is_moe else 'dense'}</p>"
            f"<p>Verdict for {verdict_target(info)}: <b style='color:{colour}'>{info.verdict}</b> — "
            f"{info.verdict_reason}</p>"
            f"{memory_html(info)}{longest_row_html(info)}{resident_layers_html(info)}{plan_notes_html(info)}"
            f"<p><b>Settings the planner would use (the Automatic recipe)</b></p><table cellpadding='3'>{rows}</table>"
        )
        self.state.set_model(info.name, info)
        self.changed.emit()

    def _show_status(self, info: ModelInfo) -> None:
        colour = VERDICT_COLOURS.get(info.verdict, "#444")
        self.status.setText(f"<b>{info.name}</b>: <span style='color:{colour}'><b>{info.verdict}</b></span>"
                            f"{self._download_note(info.name)}")  # fmt: skip

    def _data_read(self) -> None:
        """The dataset was tokenized for the chosen model: its tokenizer is on this computer now."""
        info = self.state.model_info
        if info is not None and info.name == self.state.model_name and self.missing.get(info.name):
            self.missing[info.name] = ""
            self._show_status(info)

    def _show_plan(self) -> None:
        """The chosen recipe's peak for the chosen model, as the Recipe page says it (nothing while either is being
        read)."""
        figure, info = self.state.planned_figure, self.state.model_info
        peak = describe_peak(figure) if figure is not None and figure.fits else ""
        if not peak or info is None or info.name != self.state.model_name or not self.state.planned_recipe:
            self.plan.setText("")
            return
        self.plan.setText(f"With the <b>{self.state.planned_recipe}</b> recipe (Recipe page): predicted peak {peak}")

    def step_status(self) -> tuple[bool, str]:
        """(ready, what to say) for the guide bar."""
        info = self.state.model_info
        if info is not None and info.name == self.state.model_name:
            if info.verdict == "too big":
                return False, f"Choose a smaller model: {info.name} is too big for {verdict_target(info)}"
            return True, f"{info.name}: {info.verdict}"
        if self.problem:
            return False, f"Choose another model ({self.problem})"
        if self.status.text().startswith(("Reading", "Downloading", "Converting")):
            return False, f"Reading {self.state.model_name}…"
        return False, "Choose a model (the demo is ready to try)"

    def _download_note(self, name: str) -> str:
        """For a gallery model from the hub: how much the run will download, and when."""
        row = self.gallery.row_for(name)
        if row is None or row.entry.is_demo or self.hub.isChecked():
            return ""
        missing = self.missing.get(name, "")
        if OFFLINE_MODE in missing:
            return (f" · its tokenizer is not on this computer and {OFFLINE_MODE} (HF_HUB_OFFLINE): it cannot be "
                    "fetched; unset HF_HUB_OFFLINE or choose a model that is on this computer")  # fmt: skip
        if missing:
            return (f" · its tokenizer is not on this computer: press “Look up {name}'s tokenizer on the hub” on the "
                    f"Dataset page (a few MB); its weights ({format_size(row.download_bytes)}) follow when the run "
                    "starts")  # fmt: skip
        return (f" · its weights ({format_size(row.download_bytes)}) are downloaded from the Hugging Face hub when "
                "the run starts, once")  # fmt: skip

    def _show_error(self, error: ErrorInfo) -> None:
        self.download.hide()
        self.problem = error.message
        self.changed.emit()
        self.status.setText(f"<span style='color:#b00020'>{error.message}</span>")
        self.details.setPlainText(f"{error.message}\n\nWhat to do: {error.hint or 'pick another model'}")
