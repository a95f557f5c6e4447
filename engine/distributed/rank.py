"""Training one rank's share of a run and telling its launcher about it, shared by the one-computer worker
(engine.distributed.worker) and the several-computer one (engine.distributed.node_worker)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from engine.config import RunConfig
from engine.distributed.control import CONTROL_FILE, RankControl
from engine.distributed.group import choose_mode
from engine.distributed.launch import EVENT_MARK
from engine.events import Event, RunFailed
from engine.run.ranks import Ranks

if TYPE_CHECKING:
    import torch


def train_rank(
    config: RunConfig,
    launch: dict[str, Any],
    ranks: Ranks,
    device: torch.device,
    prints_events: bool,
    on_failure: Callable[[str], None] | None = None,
    event_paths: Callable[[Event], Event] = lambda event: event,
    after: Callable[[Event], list[Event]] = lambda event: [],
) -> bool:
    """Train this rank's share, printing the events if ``prints_events`` (each followed by the events ``after`` makes
    of it); True when the run failed here."""
    from engine.run.loop import run_rank

    run_dir = Path(launch["run_dir"])
    failed = False
    try:
        ranks = choose_mode(ranks, config, device)
        control = RankControl(ranks, run_dir / CONTROL_FILE, launch.get("launcher_pid"), reads_file=prints_events)
        events = run_rank(config, run_dir, launch["resume"], ranks, device, control)
    except Exception as err:  # a ConfigError from choosing the mode: every rank raises the same one
        events = iter([RunFailed(getattr(err, "message", str(err)), getattr(err, "hint", None), 0, str(run_dir))])
    for event in events:
        if isinstance(event, RunFailed):
            failed = True
            if on_failure is not None:
                on_failure(event.message)
            say(sys.stderr, f"tunedeck rank {ranks.rank}: {event.message}")
        if prints_events:
            for printed in [event_paths(event), *after(event)]:
                say(sys.stdout, EVENT_MARK + json.dumps(printed.to_dict()))
    return failed


def say(stream: TextIO, line: str) -> None:
    """Write a line for the launcher; once it is gone (killed), keep training to the stop it causes."""
    try:
        print(line, file=stream, flush=True)
    except (BrokenPipeError, ValueError):  # the pipe closed; later writes to the closed stream raise ValueError
        with contextlib.suppress(OSError):
            stream.close()
