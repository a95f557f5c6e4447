"""What the user has chosen so far (model, dataset, settings) and what the machine is, shared by the pages.

Pages write their choice here and listen for the others' changes; none of them talks to another page directly.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QObject, Signal

from engine.config import DEMO_MODEL


class AppState(QObject):
    """The choices behind the next run."""

    hardware_changed = Signal()
    model_changed = Signal()
    data_changed = Signal()

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.hardware: Any = None
        """engine.hardware.detect.HardwareInfo once detection has run in the background."""
        self.profile: Any = None
        """engine.hardware.profile.Profile for the machine (and the model, once one is inspected)."""
        self.model_name: str = DEMO_MODEL
        self.model_info: Any = None
        """app.model_info.ModelInfo of the chosen model, or None while it is being inspected."""
        self.data_path: str = ""
        self.data_report: Any = None
        """app.dataset_report.DatasetReport of the chosen dataset."""

    def set_hardware(self, hardware: Any, profile: Any) -> None:
        self.hardware, self.profile = hardware, profile
        self.hardware_changed.emit()

    def set_model(self, name: str, info: Any) -> None:
        self.model_name, self.model_info = name, info
        self.model_changed.emit()

    def set_data(self, path: str, report: Any) -> None:
        self.data_path, self.data_report = path, report
        self.data_changed.emit()
