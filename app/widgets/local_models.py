"""The Model page's list of GGUF models already on this computer: Ollama's store, LM Studio's models folder, or a
.gguf file picked by hand, each with its size, quantization and family.

Listing reads only GGUF headers (engine.model.local_sources), in the background. Choosing one converts it once
into a Hugging Face folder (engine.model.gguf_import), which the panel runs with a progress bar.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.background.worker import ErrorInfo, TaskRunner
from app.widgets.model_gallery import format_size
from app.widgets.model_words import format_params
from app.widgets.tables import read_only_table

COLUMNS = ("Model", "From", "Size", "Quantization", "Family", "Parameters")
ORIGINS = {"ollama": "Ollama", "lmstudio": "LM Studio", "file": "file"}


def local_model_cells(model: Any) -> list[str]:
    """The table's text for one engine.model.local_sources.LocalGguf."""
    header = model.header
    family = header.architecture if model.readable else f"{header.architecture} (transformers cannot read it)"
    return [
        model.name,
        ORIGINS.get(model.origin, model.origin),
        format_size(model.size_bytes),
        header.quantization,
        family,
        format_params(header.parameters),
    ]


def convert_for_this_computer(name: str, report: Any) -> Any:
    """Convert the GGUF model ``name`` for the dtype a run on this computer computes in (runs in a thread)."""
    from engine.model.gguf_import import convert
    from engine.model.load import pick_device, pick_dtype
    from engine.model.local_sources import find_local_model

    model = find_local_model(name)
    if model is None:
        raise ValueError(f"{name} is not a GGUF model")
    return convert(model, pick_dtype("auto", pick_device("auto")), report)


def list_models_on_disk() -> list[Any]:
    from engine.model.local_sources import list_local_models

    return list_local_models()


class LocalModels(QWidget):
    """A table of the GGUF models found on this computer and a button to pick a .gguf file."""

    picked = Signal(str)
    """A row was double-clicked, or a file chosen: the name ``--model`` takes."""

    def __init__(self, tasks: TaskRunner) -> None:
        super().__init__()
        self.tasks = tasks
        self.models: list[Any] = []
        self.note = QLabel("Looking for Ollama and LM Studio models…")
        self.note.setWordWrap(True)
        self.table = read_only_table(COLUMNS)
        self.table.setMaximumHeight(160)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.cellDoubleClicked.connect(lambda row, _: self.picked.emit(self.models[row].name))
        self.pick_file = QPushButton("A .gguf file…")
        self.pick_file.clicked.connect(self._browse)
        self.rescan = QPushButton("Look again")
        self.rescan.clicked.connect(self.refresh)
        top = QHBoxLayout()
        top.addWidget(self.note, 1)
        top.addWidget(self.rescan)
        top.addWidget(self.pick_file)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(top)
        layout.addWidget(self.table)

    def refresh(self) -> None:
        self.note.setText("Looking for Ollama and LM Studio models…")
        self.tasks.start(list_models_on_disk, self._show, self._show_error)

    def selected_name(self) -> str | None:
        rows = self.table.selectionModel().selectedRows()
        if not rows or rows[0].row() >= len(self.models):
            return None
        return str(self.models[rows[0].row()].name)

    def _show(self, models: list[Any]) -> None:
        self.models = models
        self.table.setRowCount(len(models))
        for index, model in enumerate(models):
            for column, text in enumerate(local_model_cells(model)):
                item = QTableWidgetItem(text)
                item.setToolTip(f"{model.path}\n{model.header.describe_types()}")
                self.table.setItem(index, column, item)
        if models:
            count = f"{len(models)} GGUF model" + ("s" if len(models) != 1 else "")
            self.note.setText(f"{count} on this computer (double-click one to convert and use it)")
        else:
            self.note.setText("No Ollama or LM Studio models on this computer: pick a .gguf file instead.")

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "GGUF model", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.picked.emit(path)

    def _show_error(self, error: ErrorInfo) -> None:
        self.note.setText(f"<span style='color:#b00020'>Cannot list local models: {error.message}</span>")
