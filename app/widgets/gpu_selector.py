"""Which GPUs a run trains on: one checkbox per detected card, and what TuneDeck will do with them.

With one card (or none) the selector just names where the run goes. With two or more, every usable card is
ticked by default; two or more ticked cards make a multi-GPU run (one process per card under torchrun), and the
line below says whether it will use DDP or FSDP2 and why (from the planner, for the chosen model).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from engine.config import RunConfig

GIB = 1 << 30


def gpu_label(gpu: Any) -> str:
    memory = f" · {gpu.total_memory_bytes / GIB:.0f} GiB" if gpu.total_memory_bytes else ""
    return f"GPU {gpu.index}: {gpu.name}{memory}"


def gpus_setting(indices: list[int]) -> str:
    """The ``training.gpus`` value for these cards ("1" for a single card or none: the engine's default path)."""
    return ",".join(str(i) for i in indices) if len(indices) > 1 else "1"


class GpuSelector(QWidget):
    """Checkboxes for the detected GPUs and a one-line plan for the ticked ones."""

    changed = Signal()

    def __init__(self) -> None:
        super().__init__()
        self.boxes: dict[int, QCheckBox] = {}
        self.gpus: dict[int, Any] = {}
        self.title = QLabel("Trains on: looking for GPUs…")
        self.plan = QLabel("")
        self.plan.setWordWrap(True)
        self.row = QHBoxLayout()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.title)
        layout.addLayout(self.row)
        layout.addWidget(self.plan)

    def set_hardware(self, hardware: Any) -> None:
        """Offer the cards torch can use; one card or none needs no choice."""
        for box in self.boxes.values():
            self.row.removeWidget(box)
            box.deleteLater()
        usable = [gpu for gpu in getattr(hardware, "gpus", ()) if gpu.usable_by_torch]
        self.gpus = {gpu.index: gpu for gpu in usable}
        self.boxes = {}
        if len(usable) <= 1:
            self.title.setText(f"Trains on: {gpu_label(usable[0])}" if usable else "Trains on: the CPU")
            return
        self.title.setText("Trains on (tick two or more cards for a multi-GPU run):")
        for gpu in usable:
            box = QCheckBox(gpu_label(gpu))
            box.setChecked(True)
            box.toggled.connect(lambda _=False: self.changed.emit())
            self.row.addWidget(box)
            self.boxes[gpu.index] = box
        self.row.addStretch(1)
        self.changed.emit()

    def selected(self) -> list[int]:
        if not self.boxes:
            return list(self.gpus)[:1]
        return [index for index, box in self.boxes.items() if box.isChecked()]

    def apply(self, config: RunConfig) -> RunConfig:
        """The config with ``training.gpus`` set from the ticked cards (unchanged when there is nothing to pick)."""
        if not self.boxes:
            return config
        training = dataclasses.replace(config.training, gpus=gpus_setting(self.selected()))
        return dataclasses.replace(config, training=training)

    def show_plan(self, config: RunConfig) -> None:
        """DDP or FSDP2 for the ticked cards and the chosen model, with the planner's reason."""
        chosen = self.selected()
        if len(chosen) < 2:
            self.plan.setText("One GPU: a normal run." if self.boxes else "")
            return
        from engine.hardware.parallel import choose_for_run
        from engine.hardware.planner import usable_bytes

        smallest = min(self.gpus[i].total_memory_bytes or 0 for i in chosen)
        cc = self.gpus[chosen[0]].compute_capability
        plan = choose_for_run(config, len(chosen), usable_bytes(smallest), cc)
        self.plan.setText(f"{len(chosen)} GPUs, one process each: {plan.reason}")
