"""Python's cyclic garbage collector, run on the GUI thread only.

Why: Python collects cyclic garbage in whichever thread happens to allocate when a generation's threshold is
crossed. A training, export or chat thread can so end up destroying a Qt widget that became unreachable (a closed
dialog held in a reference cycle by its own signal connections), and a Qt widget destroyed outside the GUI thread
crashes the process: seen as a segmentation fault in the export worker while it was "Garbage-collecting". So the
automatic collector is switched off and a timer on the GUI thread collects instead, by the same generational
thresholds, so memory is reclaimed as before but only ever from the thread that owns the widgets.
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QCoreApplication, QObject, QTimer

INTERVAL_MS = 250
"""How often the GUI thread looks at the collector's counts (a check is a few microseconds)."""


class GuiThreadCollector(QObject):
    """Collects cyclic garbage from a timer on the GUI thread, with automatic collection off while it lives."""

    def __init__(self, parent: QObject) -> None:
        super().__init__(parent)
        self._timer = QTimer(self)
        self._timer.timeout.connect(self.collect_due)
        gc.disable()
        self._timer.start(INTERVAL_MS)

    def collect_due(self) -> int:
        """Collect the oldest generation whose count passed its threshold, as the automatic collector would;
        returns the generation collected, or -1 when none was due."""
        counts, thresholds = gc.get_count(), gc.get_threshold()
        due = [gen for gen in range(3) if thresholds[gen] and counts[gen] > thresholds[gen]]
        if not due:
            return -1
        gc.collect(due[-1])
        return due[-1]

    def stop(self) -> None:
        self._timer.stop()
        gc.enable()


def collect_on_gui_thread(app: QCoreApplication) -> GuiThreadCollector:
    """Install the collector on ``app`` once (later calls return the same one)."""
    existing = app.findChild(GuiThreadCollector)
    if isinstance(existing, GuiThreadCollector):
        return existing
    collector = GuiThreadCollector(app)
    app.aboutToQuit.connect(collector.stop)
    return collector
