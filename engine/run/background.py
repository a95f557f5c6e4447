"""A run beside a window: the training thread yields the CPU to the GUI thread.

On a two-core machine torch's intra-op pool would take both cores and the window would stutter, so the run leaves
one core to the GUI (``torch.set_num_threads(cpu_count - 1)``, at least 1) and lowers its own thread's priority.
Only the CPU pool is capped: on a GPU the work runs on the card and the cap costs nothing. Light on purpose (no
torch at import): the window imports it at start-up.

When a run ends, glibc keeps the heap its model, optimizer and data were freed into, so the window's process would
stay as large as the largest run it has seen: :func:`release_freed_memory` hands that back to the system. Measured
over 21 demo cycles of the window with pause, page switches and chats (tests/test_app_soak.py, two cores): resident
memory 807 -> 1,030 MiB (+28%) without it, 764 -> 770 MiB (+0.8%) with it (from a thread of its own); the live
Python objects grew by 47 a cycle either way (the new runs' rows), so the growth was freed heap, not a leak.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from typing import Any

__all__ = ["lower_thread_priority", "open_run_history", "release_freed_memory", "training_threads"]


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


def release_freed_memory() -> bool:
    """Return the heap's free pages to the system (glibc's ``malloc_trim``); False where there is no such call. Any
    thread may call it (ctypes lets go of the GIL); what waits for Python's cyclic collector is freed later."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols, the C library's among them
    except (OSError, AttributeError):  # musl and other C libraries have no malloc_trim
        return False
    trim(0)
    return True
