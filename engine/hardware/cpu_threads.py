"""How many threads a CPU run trains with when other programs already keep cores busy.

torch runs each operation on a pool of OpenMP threads that meet at a barrier when it ends. Where other programs
hold the cores, a pool as large as the machine waits at every barrier for a thread the scheduler has put aside:
on a shared 2-core VM with a load average of 6-7, one step of a 135M model on 128-token rows took 12-26 s with two
threads and 3.4-4.0 s with one (most operations of a step took 4-8 ms with two threads, whatever their size), and
the demo's steps took 0.36 s against 2.64 s (medians of 40, load average 5.5). So a CPU run uses the cores the load
average leaves free, never fewer than one, never more than it was given.
"""

from __future__ import annotations

import math


def cpu_threads(given: int, cores: int, load_average: float) -> tuple[int, str | None]:
    """The threads to train with (at most ``given``, torch's current count) and, where fewer, why.

    ``load_average``: the machine's one-minute load average before the run trains (others' work, mostly)."""
    free = max(1, min(given, math.floor(cores - load_average + 0.5)))
    if free >= given:
        return given, None
    busy = f"load average {load_average:.1f} on {cores} core{'s' if cores != 1 else ''}"
    why = (
        f"training with {free} CPU thread{'s' if free != 1 else ''} instead of {given}: other programs keep the "
        f"other cores busy ({busy}), and torch's threads would wait on each other at every operation"
    )
    return free, why
