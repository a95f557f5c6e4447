"""Cyclic garbage is collected on the GUI thread only, by the automatic collector's thresholds."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from app.background.gui_gc import collect_on_gui_thread


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_collector_is_installed_once_and_automatic_collection_is_off(qapp: Any) -> None:
    collector = collect_on_gui_thread(qapp)
    assert collect_on_gui_thread(qapp) is collector
    assert not gc.isenabled()


def test_due_garbage_is_collected_by_the_timer_check(qapp: Any) -> None:
    collector = collect_on_gui_thread(qapp)
    gc.collect()
    node = Node()
    alive = weakref.ref(node)
    del node
    assert alive() is not None  # the automatic collector is off: nothing frees it yet
    for _ in range(gc.get_threshold()[0] + 10):  # allocations past generation 0's threshold
        Node()
    assert collector.collect_due() >= 0
    assert alive() is None


def test_stopping_gives_collection_back_to_python() -> None:
    from PySide6.QtCore import QObject

    from app.background.gui_gc import GuiThreadCollector

    was_enabled = gc.isenabled()
    owner = QObject()
    collector = GuiThreadCollector(owner)
    assert not gc.isenabled()
    collector.stop()
    assert gc.isenabled()
    if not was_enabled:
        gc.disable()  # the session's own collector (the qapp fixture) keeps it off
