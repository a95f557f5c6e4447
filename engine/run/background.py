"""A run beside a window: the training thread yields the CPU to the GUI thread.

On a two-core machine torch's intra-op pool would take both cores and the window would stutter, so the run leaves
one core to the GUI (``torch.set_num_threads(cpu_count - 1)``, at least 1) and lowers its own thread's priority.
Only the CPU pool is capped: on a GPU the work runs on the card and the cap costs nothing. Light on purpose (no
torch at import): the window imports it at start-up.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any

__all__ = ["lower_thread_priority", "open_run_history", "training_threads"]


def training_threads(cpu_count: int | None = None) -> int:
    """CPU threads for torch during a run: all cores but one, which stays with the window."""
    return max(1, (cpu_count or os.cpu_count() or 1) - 1)


def lower_thread_priority(niceness: int = 10) -> None:
    """Let the window's thread win the CPU over the training thread when cores are busy (Linux: per thread)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)


def open_run_history() -> Any:
    """The user's run registry, or None when it cannot be opened: a run never depends on it."""
    from engine.run.registry import Registry, RegistryError

    try:
        return Registry()
    except (RegistryError, OSError):
        return None
