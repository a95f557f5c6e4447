"""One rank of a run over several computers: join, agree with node 0, train under the node watch.

The same training as a one-computer rank (engine.distributed.worker.train_rank), with four additions: the rank
takes its place by node rank (engine.distributed.nodes), every node is checked against node 0 before the first step
(engine.distributed.joined), a :class:`~engine.distributed.watch.NodeWatch` ends the rank when another node goes, and
every step is followed by each node's figures (engine.distributed.node_figures). The first rank of every node prints
the events, so each computer's terminal or app follows the run; on the other nodes their paths name node 0's run
folder, the only one there is."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from engine.config import RunConfig
from engine.distributed.group import init_node_ranks
from engine.distributed.joined import Agreed, agree, share_run_folder
from engine.distributed.launch import EVENT_MARK
from engine.distributed.node_figures import figures_after, gather_devices
from engine.distributed.nodes import JOINED_MARK, Place, link_report, store_client
from engine.distributed.rank import say, train_rank
from engine.distributed.watch import NodeWatch
from engine.events import Event, Notice, RunFailed
from engine.run.ranks import Ranks

PEER_TROUBLE = ("connection", "gloo", "nccl", "peer", "broken pipe", "timed out", "timeout", "socket")
"""Words of the errors a collective raises when another node went: the watch then names the node."""


def run_node(config: RunConfig, launch: dict[str, Any]) -> int:
    import os

    import torch.distributed as dist

    training = config.training
    ranks, device, place = init_node_ranks(training.device, training.rendezvous_timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    first_here = local_rank == 0
    watch = NodeWatch(store_client(training.node_timeout), place, training.node_timeout)
    watch.start()
    if first_here:
        say(sys.stdout, JOINED_MARK)
    run_dir = Path(launch["run_dir"])
    try:
        link = link_report("nccl" if device.type == "cuda" else "gloo", place.node)
        agreed = agree(ranks, place, config, bool(launch["resume"]), run_dir, link)
        if agreed.resuming:
            share_run_folder(ranks, place, run_dir, local_rank)
    except Exception as err:  # a mismatch: every rank raises the same ConfigError
        return _refused(err, ranks, first_here, run_dir, watch)
    devices = gather_devices(ranks, place, device)
    if first_here:
        say(sys.stdout, EVENT_MARK + json.dumps(Notice("; ".join(agreed.links)).to_dict()))
    failed = train_rank(
        agreed.config,
        {**launch, "resume": agreed.resuming},
        ranks,
        device,
        prints_events=first_here,
        on_failure=lambda message: _on_failure(watch, message),
        event_paths=_paths_on(place, run_dir, agreed),
        after=figures_after(place.node_of_rank, devices),
    )
    if not failed:
        ranks.barrier()
        watch.close()
        dist.destroy_process_group()
    return 1 if failed else 0


def _refused(err: Exception, ranks: Ranks, first_here: bool, run_dir: Path, watch: NodeWatch) -> int:
    """Every rank stops with the same message; the first rank of each node tells its launcher."""
    failed = RunFailed(getattr(err, "message", str(err)), getattr(err, "hint", None), 0, str(run_dir))
    say(sys.stderr, f"tunedeck rank {ranks.rank}: {failed.message}")
    if first_here:
        say(sys.stdout, EVENT_MARK + json.dumps(failed.to_dict()))
    watch.close()
    return 1


def _on_failure(watch: NodeWatch, message: str) -> None:
    """A collective that failed because another node went waits for the watch's verdict (which ends the process
    with it); a failure of this rank's own is posted for the other nodes to name."""
    if any(word in message.lower() for word in PEER_TROUBLE) and watch.verdict(watch.timeout_s + 3 * watch.interval_s):
        return
    watch.post_failure(message)


def _paths_on(place: Place, run_dir: Path, agreed: Agreed) -> Any:
    """On another node than 0, an event's paths name node 0's run folder instead of this node's working folder."""
    if place.node == 0:
        return lambda event: event
    here, there = str(run_dir), f"node 0:{agreed.main_run_dir}"

    def relabel(event: Event) -> Event:
        changes = {
            f.name: getattr(event, f.name).replace(here, there)
            for f in dataclasses.fields(event)
            if isinstance(getattr(event, f.name), str) and here in getattr(event, f.name)
        }
        return dataclasses.replace(event, **changes) if changes else event

    return relabel
