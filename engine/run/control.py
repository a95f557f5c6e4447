"""Steering a running job from another thread: stop, pause/resume, and new speed settings.

The training loop looks at its :class:`RunControl` between two optimizer steps, so every request takes effect
at a step boundary: a stop saves a checkpoint first, a pause keeps the model loaded and blocks until resumed,
and new speed settings apply from the next step on.
"""

from __future__ import annotations

import threading

from engine.config import SpeedConfig


class RunControl:
    """Thread-safe requests from the user to a running job."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()
        self._lock = threading.Lock()
        self._speed: SpeedConfig | None = None

    def sync(self) -> None:
        """Take in requests from outside this process, between two steps (the ranks of a multi-GPU run read
        theirs from the launcher here); a run in one process gets them directly, so nothing to do."""

    def stop(self) -> None:
        self._stop.set()
        self._running.set()  # a paused run must wake up to stop

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def wait_while_paused(self, timeout: float | None = None) -> bool:
        """Block while paused; True when the run may go on (resumed or stopping)."""
        return self._running.wait(timeout)

    def request_speed(self, settings: SpeedConfig) -> None:
        with self._lock:
            self._speed = settings

    def take_speed_request(self) -> SpeedConfig | None:
        with self._lock:
            settings, self._speed = self._speed, None
        return settings
