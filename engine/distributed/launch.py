"""Starting a multi-GPU run under torchrun and turning rank 0's output back into the run's events.

The launcher owns the run folder (it creates or reads it, as a one-process run does), then starts
``python -m torch.distributed.run --standalone --nproc-per-node W -m engine.distributed.worker`` in its own
session, with ``CUDA_VISIBLE_DEVICES`` naming the chosen GPUs and ``NCCL_NVLS_ENABLE=0`` unless set (NVLink
multicast buffers failed to allocate on shared machines). Rank 0 prints each event as a marked JSON line; the
launcher parses them back into the same event objects. Whatever happens — the run ends, fails, a rank dies, the
consumer stops iterating — torchrun and every rank are gone when the iterator ends; if the launcher itself is
killed, rank 0 notices between two steps and the run stops as if asked (checkpoint, adapter): no orphans.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import engine
from engine import events as ev
from engine.config import RunConfig
from engine.distributed.control import CONTROL_FILE, ControlMirror
from engine.distributed.nodes import (
    JOINED_MARK,
    LOCAL_ADDR_ENV,
    LOST_HINT,
    LOST_MARK,
    NODE_RANK_ENV,
    link_env,
    rendezvous_args,
    rendezvous_hint,
)
from engine.errors import ConfigError
from engine.events import Event, RunFailed, RunFinished, StepMetrics
from engine.run.control import RunControl

EVENT_MARK = "@tunedeck-event "
LAUNCH_ENV = "TUNEDECK_LAUNCH"
STDERR_TAIL = 60
HINT_LINES = 12
EXIT_GRACE_S = 60.0
LOST_GRACE_S = 5.0
"""After a rank reports a lost node, its torchrun gets this long to end on its own before the launcher ends it."""
EVENT_TYPES: dict[str, type[Event]] = {
    cls.__name__: cls
    for cls in vars(ev).values()
    if isinstance(cls, type) and issubclass(cls, Event) and cls is not Event
}


def resolve_gpus(spec: str, device: str) -> list[int]:
    """The GPU indices (or, on the CPU, process slots) a ``training.gpus`` value names on this machine."""
    spec = spec.strip().lower()
    on_cpu = device == "cpu" or (device == "auto" and not _cuda_available())
    if on_cpu and spec == "all":
        return [0]  # CPU processes are for testing the distributed path; "all" GPUs of none is one process
    available = (os.cpu_count() or 1) if on_cpu else _cuda_count()
    if "," in spec:
        indices = [int(part) for part in spec.split(",")]
        missing = [i for i in indices if i >= available]
        if missing and not on_cpu:
            raise ConfigError(
                f"training.gpus: GPU {missing[0]} does not exist (this machine has {available})",
                hint="run `tunedeck detect` to see the GPUs",
            )
        return indices
    count = available if spec == "all" else int(spec)
    if count > available and not on_cpu:
        raise ConfigError(
            f"training.gpus: {count} GPUs asked for, this machine has {available}", hint="pass --gpus all"
        )
    return list(range(count))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def event_from_dict(raw: dict[str, Any]) -> Event:
    """The event a rank sent as JSON (``Event.to_dict``)."""
    fields = dict(raw)
    return EVENT_TYPES[fields.pop("kind")](**fields)


def launch_command(world: int, rendezvous: list[str] | None = None) -> list[str]:
    """torchrun from this very Python, one process per GPU; a free local port, or the nodes' rendezvous."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(rendezvous or ["--standalone"]),
        f"--nproc-per-node={world}",
        "-m",
        "engine.distributed.worker",
    ]


def launch_env(config: RunConfig, run_dir: Path, resuming: bool, gpus: list[int]) -> dict[str, str]:
    env = dict(os.environ)
    if config.training.device != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(_visible(gpus, env.get("CUDA_VISIBLE_DEVICES")))
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    root = str(Path(engine.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    launch = {"config": config.to_dict(), "run_dir": str(run_dir), "resume": resuming, "launcher_pid": os.getpid()}
    env[LAUNCH_ENV] = json.dumps(launch)
    env[NODE_RANK_ENV] = str(config.training.node_rank)
    env.update(link_env(config.training))
    return env


def _visible(gpus: list[int], mask: str | None) -> list[str]:
    """The chosen GPUs as CUDA_VISIBLE_DEVICES names them, within a mask already set (GPU 0 of ``1,3`` is ``1``)."""
    names = [name.strip() for name in mask.split(",")] if mask else []
    return [names[i] if i < len(names) else str(i) for i in gpus]


def run_ranks(
    config: RunConfig, run_dir: Path, resuming: bool, gpus: list[int], control: RunControl
) -> Iterator[Event]:
    """Run on ``len(gpus)`` ranks here (and, with several nodes, theirs), yielding the events of this computer's
    first rank; a rank that dies becomes a RunFailed, and nodes that never meet fail after the rendezvous timeout."""
    (run_dir / CONTROL_FILE).unlink(missing_ok=True)
    mirror = ControlMirror(control, run_dir / CONTROL_FILE)
    mirror.start()
    env = launch_env(config, run_dir, resuming, gpus)
    process = subprocess.Popen(
        launch_command(len(gpus), rendezvous_args(config.training, env.get(LOCAL_ADDR_ENV))),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        bufsize=1,
        start_new_session=True,  # Ctrl-C reaches only the launcher, which turns it into a graceful stop
    )
    tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
    ranks: list[Any] = []  # the rank processes, noted once they run: they outlive a torchrun that is killed
    reader = threading.Thread(target=_drain, args=(process.stderr, tail, process, ranks), daemon=True)
    reader.start()
    meeting = _Meeting(config, process, ranks)
    try:
        yield from _events(process, tail, run_dir, reader, ranks, meeting)
    finally:
        meeting.cancel()
        mirror.close()
        _end_group(process, ranks)
        (run_dir / CONTROL_FILE).unlink(missing_ok=True)


def join_run(config: RunConfig, gpus: list[int], control: RunControl) -> Iterator[Event]:
    """Node 1, 2, ...: run this computer's ranks in a working folder of its own, gone when the run ends; node 0
    keeps the run folder and sends what a resume needs."""
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=f"tunedeck-node{config.training.node_rank}-"))
    try:
        yield from run_ranks(config, folder, False, gpus, control)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _Meeting:
    """With several nodes: ends torchrun if no rank has joined a process group within the rendezvous timeout (plus
    a grace for torchrun's own timeout to speak first), so a wrong address fails instead of waiting forever."""

    GRACE_S = 15.0

    def __init__(self, config: RunConfig, process: subprocess.Popen[str], ranks: list[Any]) -> None:
        self.training = config.training
        self.nodes = self.training.nodes
        self.joined = self.nodes <= 1
        self.expired = False
        self._timer = threading.Timer(self.training.rendezvous_timeout + self.GRACE_S, self._expire, (process, ranks))
        self._timer.daemon = True
        if not self.joined:
            self._timer.start()

    def join(self) -> None:
        self.joined = True
        self._timer.cancel()

    def cancel(self) -> None:
        self._timer.cancel()

    def _expire(self, process: subprocess.Popen[str], ranks: list[Any]) -> None:
        if not self.joined:
            self.expired = True
            _end_group(process, ranks)

    def failure(self, tail: list[str], run_dir: Path) -> RunFailed:
        shown = [line for line in tail if line.strip()][-HINT_LINES:]
        return RunFailed(
            f"the nodes did not meet at {self.training.rendezvous} within {self.training.rendezvous_timeout:.0f} s "
            f"(this is node {self.training.node_rank} of {self.training.nodes})",
            rendezvous_hint(self.training) + ("\nlast output of torchrun:\n" + "\n".join(shown) if shown else ""),
            0,
            str(run_dir),
        )


def _events(
    process: subprocess.Popen[str],
    tail: collections.deque[str],
    run_dir: Path,
    reader: threading.Thread,
    ranks: list[Any],
    meeting: _Meeting,
) -> Iterator[Event]:
    last: Event | None = None
    step = 0
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(JOINED_MARK):
            meeting.join()
            ranks.extend([] if ranks else _rank_processes(process))
            continue
        if not line.startswith(EVENT_MARK):
            tail.append(line.rstrip())
            continue
        if not ranks:
            ranks.extend(_rank_processes(process))
        event = event_from_dict(json.loads(line[len(EVENT_MARK) :]))
        if isinstance(event, (RunFinished, RunFailed)):
            last = event  # yielded once every rank has exited
            continue
        step = event.step if isinstance(event, StepMetrics) else step
        yield event
    code = _wait(process, ranks)
    reader.join(timeout=5)
    if not meeting.joined:
        yield meeting.failure(list(tail), run_dir)
        return
    lost = next((line for line in reversed(tail) if line.startswith(LOST_MARK)), None)
    if lost is not None:  # another computer went: the node watch says which, whatever the collectives raised
        yield RunFailed(lost[len(LOST_MARK) :], LOST_HINT, step, str(run_dir))
    elif meeting.nodes > 1 and isinstance(last, RunFailed):
        yield last  # this computer's first rank told the story (its rank numbers are not torchrun's)
    else:
        yield _outcome(last, code, list(tail), run_dir)


def _outcome(last: Event | None, code: int, tail: list[str], run_dir: Path) -> Event:
    if isinstance(last, RunFinished):  # sent after the final barrier: the run folder is whole whatever exit follows
        return last
    lines = [line for line in tail if line.strip()]
    cause = _root_cause(lines)
    if isinstance(last, RunFailed) and (cause is None or cause[0] == 0):
        return last
    rank, exit_code = cause or (None, code)
    mark = f"tunedeck rank {rank}:"
    own = next((line for line in reversed(lines) if rank is not None and line.startswith(mark)), None)
    who = f"the training process of rank {rank}" if rank is not None else "a training process"
    message = own or f"{who} stopped unexpectedly (exit code {exit_code})"
    shown = ([f"rank 0 then reported: {last.message}"] if isinstance(last, RunFailed) else []) + lines[-HINT_LINES:]
    hint = "last output of the training processes:\n" + "\n".join(shown) if shown else None
    return RunFailed(message, hint, last.step if isinstance(last, RunFailed) else 0, str(run_dir))


def _root_cause(lines: list[str]) -> tuple[int, int] | None:
    """The rank and exit code torchrun names as the first failure, from its error summary."""
    start = max((i for i, line in enumerate(lines) if "Root Cause" in line), default=None)
    if start is None:
        return None
    rank = code = None
    for line in lines[start:]:
        if rank is None and (found := re.match(r"\s*rank\s*:\s*(\d+)", line)):
            rank = int(found.group(1))
        if code is None and (found := re.match(r"\s*exitcode\s*:\s*(-?\d+)", line)):
            code = int(found.group(1))
    return (rank, code if code is not None else 1) if rank is not None else None


def _drain(
    stream: IO[str] | None, tail: collections.deque[str], process: subprocess.Popen[str], ranks: list[Any]
) -> None:
    if stream is None:
        return
    for line in stream:
        tail.append(line.rstrip())
        if line.startswith(LOST_MARK):  # another node went: torchrun's own goodbye to it could wait for minutes
            timer = threading.Timer(LOST_GRACE_S, _end_group, (process, ranks))
            timer.daemon = True
            timer.start()


def _wait(process: subprocess.Popen[str], ranks: list[Any]) -> int:
    try:
        return process.wait(timeout=EXIT_GRACE_S)
    except subprocess.TimeoutExpired:
        _end_group(process, ranks)
        return process.wait()


def _rank_processes(process: subprocess.Popen[str]) -> list[Any]:
    import psutil

    try:
        children: list[Any] = psutil.Process(process.pid).children(recursive=True)
        return children
    except psutil.NoSuchProcess:
        return []


def _end_group(process: subprocess.Popen[str], known: list[Any]) -> None:
    """End torchrun and every rank (each rank runs in a session of its own): SIGTERM, then SIGKILL what is left."""
    import psutil

    ranks = list({p.pid: p for p in [*known, *_rank_processes(process)]}.values())
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        ranks = [p for p in ranks if _running(p)]
        if process.poll() is not None and not ranks:
            return
        if process.poll() is None:
            process.send_signal(sig)  # torchrun passes SIGTERM on to its ranks itself
        for rank in ranks:
            with contextlib.suppress(psutil.Error):
                rank.send_signal(sig)
        deadline = time.monotonic() + grace
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace)
        _, ranks = psutil.wait_procs(ranks, timeout=max(0.0, deadline - time.monotonic()))


def _running(member: Any) -> bool:
    import psutil

    try:
        return bool(member.is_running() and member.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False
