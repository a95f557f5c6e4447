"""One rank of a multi-GPU run, as torchrun starts it: ``python -m engine.distributed.worker``.

The launcher passes the run (config, run folder, resuming or not) in the ``TUNEDECK_LAUNCH`` environment
variable. Every rank trains; rank 0 prints the run's events on stdout, each line marked so the launcher can tell
them from anything a library prints. A rank that fails says so on stderr and exits 1, which makes torchrun end
the others. Imports nothing from Qt.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from engine.config import RunConfig
from engine.distributed.control import CONTROL_FILE, RankControl
from engine.distributed.group import choose_mode, init_ranks
from engine.distributed.launch import EVENT_MARK, LAUNCH_ENV
from engine.events import Event, RunFailed
from engine.hardware.allocator import set_at_process_start
from engine.run.ranks import Ranks

if TYPE_CHECKING:
    import torch


def main() -> int:
    set_at_process_start()  # a rank's CUDA starts in init_ranks below
    import torch.distributed as dist

    from engine.quiet import quiet_libraries

    quiet_libraries()
    launch = json.loads(os.environ[LAUNCH_ENV])
    config = RunConfig.from_dict(launch["config"])
    if config.training.nodes > 1:
        from engine.distributed.node_worker import run_node

        return run_node(config, launch)
    ranks, device = init_ranks(config.training.device)
    failed = train_rank(config, launch, ranks, device, prints_events=ranks.is_main)
    if not failed:
        ranks.barrier()  # no rank tears down its connections while another still uses them
        dist.destroy_process_group()
    return 1 if failed else 0


def train_rank(
    config: RunConfig,
    launch: dict[str, Any],
    ranks: Ranks,
    device: torch.device,
    prints_events: bool,
    on_failure: Callable[[str], None] | None = None,
    event_paths: Callable[[Event], Event] = lambda event: event,
) -> bool:
    """Train this rank's share, printing the events if ``prints_events``; True when the run failed here."""
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
            _say(sys.stderr, f"tunedeck rank {ranks.rank}: {event.message}")
        if prints_events:
            _say(sys.stdout, EVENT_MARK + json.dumps(event_paths(event).to_dict()))
    return failed


def _say(stream: TextIO, line: str) -> None:
    """Write a line for the launcher; once it is gone (killed), keep training to the stop it causes."""
    try:
        print(line, file=stream, flush=True)
    except (BrokenPipeError, ValueError):  # the pipe closed; later writes to the closed stream raise ValueError
        with contextlib.suppress(OSError):
            stream.close()


if __name__ == "__main__":
    sys.exit(main())
