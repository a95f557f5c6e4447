"""The computers of a run over several: each node's devices, step time and memory, and which node is slower.

Fed with the run's :class:`~engine.events.NodeFigures` events (one after every step of a run with ``--nodes``); hidden
for a run on one computer. The step time is the node's busy time, its waits for the other node left out
(engine.run.busy), so a slower computer shows even though both end every step together.
"""

from __future__ import annotations

from PySide6.QtWidgets import (
    QAbstractItemView,
    QGroupBox,
    QHeaderView,
    QLabel,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
)

from engine.distributed.node_figures import slower_line
from engine.events import NodeFigures

COLUMNS = ("Node", "Device", "Step time", "Memory")


class NodeTable(QGroupBox):
    """One row per computer, updated after every step; a line below says which one holds the run back."""

    def __init__(self) -> None:
        super().__init__("Computers in this run")
        self.this_node = 0
        """The node rank of the computer this app runs on (1 when it joined another's run)."""
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.verticalHeader().hide()
        header = self.table.horizontalHeader()
        for column in range(len(COLUMNS)):
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        self.table.setToolTip(
            "Step time: the seconds a computer works on a step, without its waits for the other one. "
            "Memory: its largest GPU memory peak (reserved), or the process's resident memory on a CPU."
        )
        self.slower = QLabel("")
        self.slower.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addWidget(self.table)
        layout.addWidget(self.slower)
        self.hide()

    def show_figures(self, figures: NodeFigures) -> None:
        self.table.setRowCount(len(figures.devices))
        for node, device in enumerate(figures.devices):
            cells = (
                f"{node}" + (" (this computer)" if node == self.this_node else ""),
                device,
                f"{figures.step_time_s[node]:.2f} s",
                f"{figures.memory_bytes[node] / 2**30:.2f} GiB",
            )
            for column, text in enumerate(cells):
                self.table.setItem(node, column, QTableWidgetItem(text))
        self.table.setFixedHeight(self._table_height())
        said = slower_line(figures)
        self.slower.setText(f"Step {figures.step}: " + (said[0].upper() + said[1:] if said else "the nodes keep pace."))
        self.show()

    def clear(self) -> None:
        self.table.setRowCount(0)
        self.slower.setText("")
        self.hide()

    def _table_height(self) -> int:
        rows = sum(self.table.rowHeight(row) for row in range(self.table.rowCount()))
        return rows + self.table.horizontalHeader().height() + 2 * self.table.frameWidth()
