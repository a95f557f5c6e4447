"""First-run page: which GPU TuneDeck found and what it will do with it, each choice with its reason.

Detection imports torch (to see what this torch build can use), so it runs in the background after the window
is shown; until then the page says it is looking.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import QHeaderView, QLabel, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget

from app.app_state import AppState
from app.background.worker import ErrorInfo, TaskRunner

GIB = 1 << 30
SETTING_NAMES = {
    "dtype": "Precision",
    "attention_backend": "Attention kernel",
    "metadata_cache": "Metadata caching",
    "checkpointing": "Checkpointing",
    "moe_routing": "MoE routing",
    "qlora": "QLoRA",
    "tokens_per_batch": "Tokens per batch",
}


def detect_machine() -> tuple[Any, Any]:
    """Hardware and the device profile (no model yet); runs in a background thread."""
    from engine.hardware.detect import detect_hardware
    from engine.hardware.profile import build_profile

    hardware = detect_hardware()
    return hardware, build_profile(hardware)


def describe_gpu(hardware: Any) -> str:
    """One paragraph a user can read: the card, its memory and architecture, or the CPU path."""
    gpu = hardware.primary
    if gpu is None:
        memory = f"{hardware.host_memory_bytes / GIB:.0f} GiB RAM" if hardware.host_memory_bytes else "RAM unknown"
        return f"No NVIDIA GPU found: training runs on the CPU ({hardware.cpu_count} cores, {memory})."
    cc = gpu.compute_capability
    sm = f"sm_{cc[0]}{cc[1]}" if cc else "sm_?"
    total = f"{gpu.total_memory_bytes / GIB:.1f} GiB" if gpu.total_memory_bytes else "? GiB"
    kind = "unified memory" if gpu.integrated else "dedicated memory"
    return f"{gpu.name} ({gpu.architecture}, {sm}): {total} {kind}, class {gpu.gpu_class}."


class HardwarePanel(QWidget):
    """Shows the detected machine and the profile's choices with their reasons."""

    def __init__(self, state: AppState, tasks: TaskRunner) -> None:
        super().__init__()
        self.state = state
        self.tasks = tasks
        self.summary = QLabel("Looking for an NVIDIA GPU…")
        self.summary.setWordWrap(True)
        self.versions = QLabel("")
        self.versions.setWordWrap(True)
        self.table = QTableWidget(0, 3)
        self.table.setHorizontalHeaderLabels(["Setting", "TuneDeck will use", "Why"])
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.verticalHeader().setVisible(False)
        self.table.setWordWrap(True)
        self.notes = QLabel("")
        self.notes.setWordWrap(True)
        layout = QVBoxLayout(self)
        for widget in (self.summary, self.versions):
            layout.addWidget(widget)
        layout.addWidget(QLabel("<b>What TuneDeck will do with it</b>"))
        layout.addWidget(self.table)
        layout.addWidget(self.notes)
        layout.addStretch(1)

    def detect(self) -> None:
        self.tasks.start(detect_machine, self._show, self._show_error)

    def _show(self, result: tuple[Any, Any]) -> None:
        hardware, profile = result
        self.summary.setText(describe_gpu(hardware))
        self.versions.setText(
            f"driver {hardware.driver_version or '-'} · torch {hardware.torch_version or '-'} "
            f"(CUDA build {hardware.torch_cuda_version or 'none'}) · {hardware.platform}"
            f"{' (WSL)' if hardware.wsl else ''}"
        )
        self.show_profile(profile)
        notes = [f"Note: {note}" for note in (*hardware.notes, *profile.notes)]
        self.notes.setText("<br>".join([*notes, "<br><b>Next:</b> pick a model on the Model page (the built-in demo "
                                        "is ready), then a dataset."]))  # fmt: skip
        self.state.set_hardware(hardware, profile)

    def show_profile(self, profile: Any) -> None:
        choices = profile.choices()
        self.table.setRowCount(len(choices))
        for row, (name, choice) in enumerate(choices.items()):
            value = choice.value
            shown = ("on" if value else "off") if isinstance(value, bool) else str(value)
            for column, text in enumerate((SETTING_NAMES.get(name, name), shown, choice.reason)):
                self.table.setItem(row, column, QTableWidgetItem(text))
        self.table.resizeRowsToContents()
        rows = sum(self.table.rowHeight(row) for row in range(self.table.rowCount()))
        self.table.setFixedHeight(rows + self.table.horizontalHeader().height() + 4)

    def _show_error(self, error: ErrorInfo) -> None:
        hint = f" — {error.hint}" if error.hint else ""
        self.summary.setText(f"Could not read the hardware: {error.message}{hint}")
