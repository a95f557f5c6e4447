"""Export a run: its adapter, a merged model, or (when the engine has it) a GGUF file for llama.cpp and Ollama.

The export runs in a background thread (a merge loads the whole base model and can take minutes); the dialog
shows each stage, says clearly what went wrong, and offers to open the folder when it is done. Exports go to
``<run folder>/exports/<kind>`` unless the user picks another folder. A merged model is offered in the dtype the
run computed in; a GGUF export says which tensor types its file holds and can then be installed into Ollama or
LM Studio (``install_panel``). GGUF is offered only when
``engine.export`` provides ``export_gguf``; otherwise its choice is disabled and its tooltip says why.
"""

from __future__ import annotations

import html
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QComboBox,
    QDialog,
    QFileDialog,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QRadioButton,
    QScrollArea,
    QVBoxLayout,
    QWidget,
)

from app.background.worker import ErrorInfo, TaskRunner
from app.theme import ERROR_COLOR
from app.widgets.adapter_choice import AdapterChoice
from app.widgets.fitted_label import FittedLabel
from app.widgets.install_panel import InstallPanel

Report = Callable[[str, float, float | None], None]
MERGED_DTYPES = ("bfloat16", "float16", "float32")
KINDS = {
    "adapter": "Adapter only: small; loads on the same base model with peft",
    "merged": "Merged model: the base with the adapter folded in; loads anywhere, no peft needed",
    "gguf": "GGUF: one file for llama.cpp, Ollama and LM Studio",
}
NO_GGUF = "GGUF export is not part of this TuneDeck's engine yet (engine.export has no export_gguf)."


def gguf_quants() -> tuple[str, ...]:
    """The GGUF quantisations the engine can write, or () when it has no GGUF export."""
    try:
        export = importlib.import_module("engine.export")
    except ImportError:
        return ()
    if not callable(getattr(export, "export_gguf", None)):
        return ()
    return tuple(getattr(export, "GGUF_QUANTS", ()))


def run_dtype_or_default(run_folder: Path) -> str:
    """The dtype the run computed in (what a merged export keeps), or bfloat16 for a folder without a config."""
    from engine.errors import TuneDeckError
    from engine.export.merged import run_dtype

    try:
        return run_dtype(run_folder)
    except (TuneDeckError, OSError):
        return "bfloat16"


def gguf_summary(folder: Path) -> str:
    """The tensor types of the export's GGUF file, and a better type where many fell back ("" if unreadable)."""
    from engine.export.gguf_types import tensor_types
    from engine.export.install import read_export

    try:
        types = tensor_types(read_export(folder).gguf)
    except Exception:  # a file this TuneDeck cannot read back: the export stands, without a summary
        return ""
    advice = types.suggestion()
    return f"Tensor types: {types.summary()}. " + (f"Note: {advice}. " if advice else "")


def export_job(
    kind: str, run_folder: Path, target: Path, option: str, overwrite: bool, adapter: str = "best"
) -> Callable[[Report], Path]:
    """A job for the background thread: runs the export of the run's ``adapter`` (best or last) and reports its
    stages through ``report``."""

    def job(report: Report) -> Path:
        import engine.export as export

        if kind == "adapter":
            report("Copying the adapter and its tokenizer…", 0, None)
            return export.export_adapter(run_folder, target, overwrite=overwrite, adapter=adapter)
        if kind == "merged":
            report(f"Loading the base model and merging the adapter ({option})…", 0, None)
            return export.export_merged(run_folder, target, dtype=option, overwrite=overwrite, adapter=adapter)
        if kind == "gguf":

            def progress(event: Any) -> None:
                total = event.total or None
                report(event.message or event.stage, float(event.done), None if total is None else float(total))

            report("Preparing the GGUF export…", 0, None)
            return export.export_gguf(
                run_folder, target, quant=option, overwrite=overwrite, on_progress=progress, adapter=adapter
            )
        raise ValueError(f"unknown export kind {kind!r}")

    return job


class ExportDialog(QDialog):
    """What to export, where to, the progress, and Open folder once it is written."""

    def __init__(self, run_folder: str | Path, run_name: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.run_folder = Path(run_folder)
        self.setWindowTitle(f"Export {run_name or self.run_folder.name}")
        self.tasks = TaskRunner(self)
        # the exported path (tests read it); it hides QDialog.result(), which nothing here calls
        self.result: Path | None = None  # type: ignore[assignment]
        self.quants = gguf_quants()
        self.kinds = {kind: QRadioButton(text) for kind, text in KINDS.items()}
        self.adapter = AdapterChoice()
        self.adapter.show_run(self.run_folder)
        self.dtype = QComboBox()
        self.dtype.addItems(MERGED_DTYPES)
        self.dtype.setCurrentText(run_dtype_or_default(self.run_folder))
        self.quant = QComboBox()
        self.quant.addItems(self.quants)
        if "q8_0" in self.quants:
            self.quant.setCurrentText("q8_0")
        self.target = QLineEdit()
        self.overwrite = QCheckBox("Replace what is already in that folder")
        self.progress = QProgressBar()
        self.status = FittedLabel("", lines=0)  # a path is one long word: it wraps anywhere, never widens the dialog
        self.error = FittedLabel("", lines=0)
        self.export_button = QPushButton("Export")
        self.open_button = QPushButton("Open folder")
        self.close_button = QPushButton("Close")
        self.install = InstallPanel()
        self._build()
        self._connect()
        self.kinds["adapter"].setChecked(True)
        self._set_idle()

    def _build(self) -> None:
        choices = QGridLayout()
        group = QButtonGroup(self)
        for row, button in enumerate(self.kinds.values()):
            group.addButton(button)
            choices.addWidget(button, row, 0)
        choices.addWidget(self.dtype, 1, 1)
        choices.addWidget(self.quant, 2, 1)
        choices.setColumnStretch(0, 1)
        if not self.quants:
            self.kinds["gguf"].setEnabled(False)
            self.kinds["gguf"].setToolTip(NO_GGUF)
            self.quant.hide()
        folder = QHBoxLayout()
        browse = QPushButton("Choose…")
        browse.clicked.connect(self._browse)
        folder.addWidget(QLabel("Folder:"))
        folder.addWidget(self.target, 1)
        folder.addWidget(browse)
        self.error.setStyleSheet(f"color:{ERROR_COLOR}")
        buttons = QHBoxLayout()
        buttons.addWidget(self.export_button)
        buttons.addWidget(self.open_button)
        buttons.addStretch(1)
        buttons.addWidget(self.close_button)
        body = QWidget()
        layout = QVBoxLayout(body)
        run = FittedLabel(f"Run folder: {html.escape(str(self.run_folder))}")
        layout.addWidget(run)
        weights = QHBoxLayout()
        weights.addWidget(QLabel("Weights:"))
        weights.addWidget(self.adapter, 1)
        layout.addLayout(weights)
        layout.addLayout(choices)
        layout.addLayout(folder)
        layout.addWidget(self.overwrite)
        layout.addWidget(self.progress)
        layout.addWidget(self.status)
        layout.addWidget(self.error)
        layout.addWidget(self.install)
        layout.addStretch(1)
        scroll = QScrollArea()  # an install's instructions and answers can outgrow a laptop screen: they scroll
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        scroll.setWidget(body)
        scroll.setMinimumWidth(body.minimumSizeHint().width() + scroll.verticalScrollBar().sizeHint().width())
        outer = QVBoxLayout(self)
        outer.addWidget(scroll, 1)
        outer.addLayout(buttons)
        self.resize(640, min(body.sizeHint().height() + 60, 700))

    def _connect(self) -> None:
        for button in self.kinds.values():
            button.toggled.connect(self._suggest_target)
        self.dtype.currentTextChanged.connect(self._suggest_target)
        self.quant.currentTextChanged.connect(self._suggest_target)
        self.export_button.clicked.connect(self.start)
        self.open_button.clicked.connect(self.open_folder)
        self.close_button.clicked.connect(self.reject)

    def kind(self) -> str:
        return next(kind for kind, button in self.kinds.items() if button.isChecked())

    def option(self) -> str:
        """The merged model's dtype or the GGUF quantisation ("" for the adapter)."""
        return {"merged": self.dtype.currentText(), "gguf": self.quant.currentText()}.get(self.kind(), "")

    def _suggest_target(self) -> None:
        if not any(button.isChecked() for button in self.kinds.values()):
            return
        if self.result is not None and not self.busy():  # another choice: what the last export said is not so of it
            self.result = None
            self.status.setText("")
            self.error.setText("")
            self.progress.setValue(0)
            self.open_button.setEnabled(False)
            self.install.set_export(None, None)
        name = "-".join(part for part in (self.kind(), self.option()) if part)
        self.target.setText(str(self.run_folder / "exports" / name))
        self.dtype.setEnabled(self.kind() == "merged")
        self.quant.setEnabled(self.kind() == "gguf" and bool(self.quants))

    def _browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Export into", str(self.run_folder))
        if folder:
            self.target.setText(folder)

    def busy(self) -> bool:
        return self.tasks.busy() or self.install.busy()

    def start(self) -> None:
        """Export in the background with the current choices."""
        text = self.target.text().strip()
        if not text:
            self.show_error(ErrorInfo("choose a folder to export into"))
            return
        if self.install.busy():  # the install reads the last export's file: it must not be replaced meanwhile
            self.error.setText("<b>Not now:</b> an install is still running; export again once it has finished.")
            return
        self.result = None
        self.install.set_export(None, None)
        self.error.setText("")
        self.open_button.setEnabled(False)
        self.export_button.setEnabled(False)
        self.close_button.setEnabled(False)
        self.progress.setRange(0, 0)  # busy until a stage reports its size
        which = self.adapter.which()
        job = export_job(self.kind(), self.run_folder, Path(text), self.option(), self.overwrite.isChecked(), which)
        self.tasks.start(job, self._done, self.show_error, self._progress)

    def _progress(self, what: str, done: float, total: Any) -> None:
        self.status.setText(what)
        if total:
            self.progress.setRange(0, 1000)
            self.progress.setValue(round(1000 * min(1.0, done / float(total))))
        else:
            self.progress.setRange(0, 0)

    def _done(self, path: Any) -> None:
        self.result = Path(path)
        self._set_idle()
        self.progress.setRange(0, 1)
        self.progress.setValue(1)
        self.status.setText(f"Exported to {self.result}")
        folder = self.export_folder()
        assert folder is not None
        if (folder / "Modelfile").exists():  # a GGUF export for Ollama and LM Studio
            from engine.export.gguf import model_slug

            command = f"ollama create {model_slug(self.run_folder.name)} -f {folder / 'Modelfile'}"
            self.status.setText(f"Exported to {self.result}. {gguf_summary(folder)}For Ollama: {command}")
            self.install.set_export(self.run_folder, folder, self.adapter.which())
        self.open_button.setEnabled(True)

    def show_error(self, error: ErrorInfo) -> None:
        self._set_idle()
        self.status.setText("The export did not finish; nothing was left half-written.")
        advice = (error.hint or "").replace("pass --overwrite", f"tick “{self.overwrite.text()}”")
        hint = f"<br>What to do: {html.escape(advice)}" if advice else ""
        self.error.setText(f"<b>Export failed:</b> {html.escape(error.message)}{hint}")

    def _set_idle(self) -> None:
        self.progress.setRange(0, 1)
        self.progress.setValue(0)
        self.export_button.setEnabled(True)
        self.close_button.setEnabled(True)
        self.open_button.setEnabled(self.result is not None)

    def export_folder(self) -> Path | None:
        """The folder holding the last export (the export itself, or the folder of an exported file)."""
        if self.result is None:
            return None
        return self.result if self.result.is_dir() else self.result.parent

    def open_folder(self) -> None:
        folder = self.export_folder()
        if folder is not None and not QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder))):
            # no file manager is set up here (a bare desktop, a remote session): the path to copy instead
            self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            self.status.setText(f"No file manager opened the folder. Its path, to copy: {html.escape(str(folder))}")

    def reject(self) -> None:
        if not self.busy():  # an export cannot be cut short half-way: Close waits until it is done
            super().reject()

    def done(self, result: int) -> None:
        self.tasks.wait_all()
        self.install.tasks.wait_all()
        super().done(result)
