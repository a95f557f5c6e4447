"""Stop, pause and speed requests from the launching process to every rank, acted on at the same step.

The launcher mirrors its :class:`~engine.run.control.RunControl` into ``control.json`` in the run folder (atomic
replace, only when something changed). Between two steps rank 0 reads the file (and, in a run over several
computers, the first rank of each other node reads its own launcher's) and one small all-reduce over the gloo group
shares what they found; every rank's :class:`RankControl` then answers the training loop's questions identically.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from engine.config import SpeedConfig
from engine.run.checkpoint import write_text_atomic
from engine.run.control import RunControl
from engine.run.ranks import Ranks

CONTROL_FILE = "control.json"
PAUSE_POLL_S = 0.2


def write_control(path: Path, *, stop: bool, pause: bool, speed_seq: int, speed: SpeedConfig | None) -> None:
    record = {"stop": stop, "pause": pause, "speed_seq": speed_seq, "speed": asdict(speed) if speed else None}
    write_text_atomic(path, json.dumps(record) + "\n")


def read_control(path: Path) -> dict[str, Any]:
    try:
        record: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return record
    except (OSError, ValueError):  # not written yet
        return {}


class RankControl(RunControl):
    """A rank's view of the launcher's requests; :meth:`sync` (a collective) refreshes it between steps.

    Rank 0 reads its launcher's control file; on another computer its first rank reads that node's own, and a stop
    asked there (or a launcher killed there) stops every node too. Pause and speed changes come from node 0."""

    def __init__(self, ranks: Ranks, path: Path, launcher_pid: int | None = None, reads_file: bool = False) -> None:
        super().__init__()
        self.ranks = ranks
        self.path = path
        self.launcher_pid = launcher_pid
        self.reads_file = reads_file or ranks.is_main
        self._speed_seq = 0

    def sync(self) -> None:
        """Take the launchers' requests on every rank; a launcher that died asks for a stop."""
        record = read_control(self.path) if self.reads_file else {}
        if self.reads_file and not _alive(self.launcher_pid):
            record["stop"] = True  # the app or CLI was killed: save a checkpoint and end, leaving no orphan
        flags = torch.tensor([int(bool(record.get("stop"))), 0, 0])
        if self.ranks.is_main:
            flags[1:] = torch.tensor([int(bool(record.get("pause"))), int(record.get("speed_seq", 0))])
        if self.ranks.distributed:
            import torch.distributed as dist

            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ranks.control_group)
        stop, pause, speed_seq = (int(v) for v in flags.tolist())
        if speed_seq != self._speed_seq:
            self._speed_seq = speed_seq
            settings = self.ranks.broadcast_object(record.get("speed"))
            if settings is not None:
                self.request_speed(SpeedConfig(**settings))
        if stop:
            self.stop()
        if pause and not stop:
            self.pause()
        else:
            self.resume()

    def wait_while_paused(self, timeout: float | None = None) -> bool:
        while self.paused:
            time.sleep(PAUSE_POLL_S)
            self.sync()
        return True


def _alive(pid: int | None) -> bool:
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else (the pid was reused): treat as gone
        return False
    return True


class ControlMirror:
    """In the launcher: a thread copying a RunControl's state into the control file whenever it changes."""

    def __init__(self, control: RunControl, path: Path) -> None:
        self.control = control
        self.path = path
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tunedeck-control-mirror", daemon=True)

    def start(self) -> None:
        self._write(False, False, 0, None)
        self._thread.start()

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        last = (False, False)
        seq, speed = 0, None
        while not self._done.wait(0.1):
            requested = self.control.take_speed_request()
            now = (self.control.stop_requested, self.control.paused)
            if requested is not None:
                seq, speed = seq + 1, requested
            if now != last or requested is not None:
                self._write(now[0], now[1], seq, speed)
                last = now

    def _write(self, stop: bool, pause: bool, seq: int, speed: SpeedConfig | None) -> None:
        with contextlib.suppress(OSError):  # the run folder's disk is full: the run itself reports that
            write_control(self.path, stop=stop, pause=pause, speed_seq=seq, speed=speed)
