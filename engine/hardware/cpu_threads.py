"""How many threads a CPU run trains with when other programs already keep cores busy.

torch runs each operation on a pool of OpenMP threads that meet at a barrier when it ends. Where other programs
hold the cores, a pool as large as the machine waits at every barrier for a thread the scheduler has put aside:
on a shared 2-core VM with a load average of 6-7, one step of a 135M model on 128-token rows took 12-26 s with two
threads and 3.4-4.0 s with one (most operations of a step took 4-8 ms with two threads, whatever their size), and
the demo's steps took 0.36 s against 2.64 s (medians of 40, load average 5.5). So a CPU run uses the cores other
programs leave free, never fewer than one, never more than it was given.

What others keep busy is measured just before the run trains (:func:`busy_cores`): on Linux, the machine's busy time
over a quarter of a second less this process's own, so neither the run's start-up nor an earlier run in the same
process (whose work a load average would still count for a minute) lowers it; elsewhere the one-minute load average.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

PROC_STAT = Path("/proc/stat")
SAMPLE_S = 0.25
"""How long :func:`busy_cores` watches the machine."""


def cpu_threads(given: int, cores: int, busy: float) -> tuple[int, str | None]:
    """The threads to train with (at most ``given``, torch's current count) and, where fewer, why.

    ``busy``: how many cores other programs keep busy before the run trains (:func:`busy_cores`)."""
    free = max(1, min(given, math.floor(cores - busy + 0.5)))
    if free >= given:
        return given, None
    busy_text = f"about {busy:.1f} of {cores} core{'s' if cores != 1 else ''} busy"
    why = (
        f"training with {free} CPU thread{'s' if free != 1 else ''} instead of {given}: other programs keep the "
        f"other cores busy ({busy_text}), and torch's threads would wait on each other at every operation"
    )
    return free, why


def _busy_seconds(stat_line: str, ticks_per_s: int) -> float:
    """CPU seconds the machine has spent busy, from /proc/stat's ``cpu`` line (guest time is inside user time)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in stat_line.split()[1:9])
    return (user + nice + system + irq + softirq + steal) / ticks_per_s


def busy_cores(sample_s: float = SAMPLE_S) -> float | None:
    """Cores other programs keep busy now, or None where this cannot be told (no /proc/stat and no load average)."""
    if not PROC_STAT.exists():
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    ticks = os.sysconf("SC_CLK_TCK")
    machine, own, wall = _machine_busy(ticks), time.process_time(), time.monotonic()
    time.sleep(sample_s)
    others = (_machine_busy(ticks) - machine) - (time.process_time() - own)
    return max(0.0, others / (time.monotonic() - wall))


def _machine_busy(ticks_per_s: int) -> float:
    return _busy_seconds(PROC_STAT.read_text().splitlines()[0], ticks_per_s)
