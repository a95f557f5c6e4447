"""The model gallery on the Model page: popular models with their download size and how they train on a card.

The card is this computer's (once detected) or one picked from the GPU table, to see what a bigger or smaller
card would do. The rows come from engine.hardware.gallery (the memory planner), computed in the background.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.background.worker import ErrorInfo, TaskRunner
from app.widgets.model_words import format_params
from app.widgets.tables import read_only_table
from engine.config import DEMO_MODEL

GIB = 1 << 30
THIS_COMPUTER = "This computer"
VERDICT_TEXT = {"LoRA": "LoRA", "QLoRA": "QLoRA only", "too big": "does not fit"}
VERDICT_COLOURS = {"LoRA": "#1b7f3b", "QLoRA": "#b26a00", "too big": "#b00020"}
MIN_VISIBLE_ROWS = 4
"""The gallery rows shown however small the window (the others scroll in the table)."""
PEAK_COLUMN = "Peak, Automatic recipe"
COLUMNS = ("Model", "Parameters", "Download", "Trains with", PEAK_COLUMN, "Longest row", "About")
"""The peak is the plan's prediction for the Automatic recipe (the figure the Model and Recipe pages show for it),
never a measured figure; the tooltip tells the peak at the longest row."""


def format_size(count: float, unit: str = "B") -> str:
    for suffix, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {suffix}{unit}" if unit == "B" else f"{count / size:.1f}{suffix}"
    return f"{count:.0f} {unit}" if unit == "B" else f"{count:.0f}"


def row_cells(row: Any) -> list[str]:
    """The table's text for one engine.hardware.gallery.GalleryRow."""
    from engine.hardware.planner import LONGEST_ROW_TOKENS
    from engine.hardware.recipes import describe_peak

    automatic = row.automatic
    memory = "—" if automatic is None else describe_peak(automatic) or "—"
    if automatic is not None and automatic.tokens_per_batch:  # the row decides the peak: say which one it is for
        memory += f" ({automatic.tokens_per_batch:,}-token rows)"
    longest = row.longest_tokens
    longest_text = "—" if longest is None else f"{longest:,} tokens" + ("+" if longest >= LONGEST_ROW_TOKENS else "")
    download = "ships with TuneDeck" if row.entry.is_demo else format_size(row.download_bytes)
    about = row.entry.about + (" (gated: accept the licence on the hub, then log in)" if row.entry.gated else "")
    return [row.name, format_params(row.params), download, VERDICT_TEXT[row.verdict], memory, longest_text, about]


def card_choices() -> list[tuple[str, str | None]]:
    """(label, GPU table name) for the card box: this computer first, then every card the table knows."""
    from engine.hardware import gpus

    return [(THIS_COMPUTER, None), *((f"{s.name} · {s.vram_gib:g} GiB", s.name) for s in gpus.GPUS)]


def plan_gallery(card: str | None, hardware: Any) -> list[Any]:
    """Rows for a card of the GPU table, or for this computer (runs in a background thread)."""
    from engine.hardware import gpus
    from engine.hardware.gallery import gallery_rows
    from engine.hardware.profile import DeviceTarget

    if card is None:
        return gallery_rows(hardware)
    spec = gpus.find_gpu(card)
    if spec is None:
        raise ValueError(f"unknown GPU '{card}'")
    return gallery_rows(DeviceTarget.from_spec(spec))


class ModelGallery(QWidget):
    """A card box and a table of models; double-clicking a row picks it."""

    picked = Signal(str)
    """A row was double-clicked: its hub id ('demo' for the demo)."""

    def __init__(self, tasks: TaskRunner) -> None:
        super().__init__()
        self.tasks = tasks
        self.hardware: Any = None
        self.rows: list[Any] = []
        self.card = QComboBox()
        for label, name in card_choices():
            self.card.addItem(label, name)
        self.card.setToolTip("Plan for this computer's GPU, or for another card to see what it would train")
        self.card.currentIndexChanged.connect(lambda _: self.refresh())
        self.note = QLabel("Looking at this computer…")
        self.table = read_only_table(COLUMNS)
        self.table.setWordWrap(False)  # one line a row: the rows are computed before the columns are sized
        self.table.setSizeAdjustPolicy(QAbstractItemView.SizeAdjustPolicy.AdjustToContents)  # every row, given room
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setStretchLastSection(True)
        self.table.cellDoubleClicked.connect(lambda row, _: self.picked.emit(self.rows[row].entry.hub_id))
        top = QHBoxLayout()
        top.addWidget(QLabel("Plan for:"))
        top.addWidget(self.card)
        top.addWidget(self.note, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(top)
        layout.addWidget(self.table)

    def set_hardware(self, hardware: Any) -> None:
        self.hardware = hardware
        if self.card.currentData() is None:
            self.refresh()

    def refresh(self) -> None:
        card = self.card.currentData()
        if card is None and self.hardware is None:
            self.note.setText("Looking at this computer…")
            return
        self.note.setText("Planning…")
        hardware = self.hardware
        self.tasks.start(lambda: (card, plan_gallery(card, hardware)), self._show, self._show_error)

    def _show(self, result: tuple[str | None, list[Any]]) -> None:
        card, rows = result
        if card != self.card.currentData():
            return  # another card was picked meanwhile
        chosen = self.selected_hub_id()
        self.rows = rows
        self.table.setRowCount(len(rows))
        for index, row in enumerate(rows):
            for column, text in enumerate(row_cells(row)):
                item = QTableWidgetItem(text)
                if column == COLUMNS.index("Trains with"):
                    item.setForeground(QColor(VERDICT_COLOURS[row.verdict]))
                item.setToolTip(self._tooltip(row))
                self.table.setItem(index, column, item)
        self.table.resizeRowsToContents()
        # Every row where the page has room; a few, and the table's own scroll bar, on a small screen.
        frame = self.table.horizontalHeader().height() + 2 * self.table.frameWidth()
        heights = [self.table.rowHeight(i) for i in range(len(rows))]
        self.table.setMaximumHeight(frame + sum(heights))
        self.table.setMinimumHeight(frame + sum(heights[:MIN_VISIBLE_ROWS]))
        self.note.setText(self._card_note(card))
        self.select(chosen or DEMO_MODEL)

    def _card_note(self, card: str | None) -> str:
        if card is not None:
            return f"planned for the {card} instead of this computer"
        gpu = getattr(self.hardware, "primary", None)
        return f"on this computer's {gpu.name}" if gpu is not None else "on this computer (no NVIDIA GPU: the CPU)"

    def _tooltip(self, row: Any) -> str:
        lines = [f"{row.entry.hub_id}"]
        for way, fit in (("LoRA", row.lora), ("QLoRA", row.qlora)):
            if fit is None:
                lines.append(f"{way}: needs an NVIDIA GPU")
            else:
                lines.append(f"{way}: {'fits' if fit.fits else 'does not fit'} — {fit.reason}")
                if fit.fits and fit.memory:
                    lines.append(f"    at its longest planned row: {fit.memory}")
        if row.lora is not None and row.qlora is None:  # a CPU plan: the budget is RAM, not memory in use
            lines.append("Usable: the share of this computer's RAM planned for a run (the rest stays with the system)")
        return "\n".join(lines)

    def select(self, hub_id: str) -> None:
        for index, row in enumerate(self.rows):
            if row.entry.hub_id == hub_id:
                self.table.selectRow(index)
                return

    def selected_hub_id(self) -> str | None:
        rows = self.table.selectionModel().selectedRows()
        if not rows or rows[0].row() >= len(self.rows):
            return None
        return self.rows[rows[0].row()].entry.hub_id

    def row_for(self, hub_id: str) -> Any:
        return next((row for row in self.rows if row.entry.hub_id == hub_id), None)

    def _show_error(self, error: ErrorInfo) -> None:
        self.note.setText(f"<span style='color:#b00020'>Cannot plan: {error.message}</span>")
