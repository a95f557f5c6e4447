"""Several computers as one run: torchrun's c10d rendezvous, each node's place, and the link the ranks talk over.

``--nodes 2 --node-rank R --rendezvous HOST:PORT`` starts the same launcher and worker as ``--gpus``; torchrun then
meets the other nodes at HOST:PORT (node 0 hosts the rendezvous store there) instead of ``--standalone``. The c10d
rendezvous numbers the nodes in an order of its own (sorted host names and process ids), so each rank takes its
place from ``--node-rank`` instead: ranks are ordered by (node rank, local rank), which keeps global rank 0 on node
0, the computer that holds the run folder and reads the app's requests. A rendezvous nobody answers fails after
``training.rendezvous_timeout`` seconds with a hint (address, port, firewall) instead of waiting forever.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from engine.errors import ConfigError

NODE_RANK_ENV = "TUNEDECK_NODE_RANK"
LOCAL_ADDR_ENV = "TUNEDECK_NODE_ADDRESS"
RUN_ID = "tunedeck"
LOST_MARK = "tunedeck node lost: "
"""Starts the line a rank prints on stderr when the node watch finds another node gone (engine.distributed.watch)."""
LOST_HINT = (
    "the run folder on node 0 keeps the last checkpoint: resume it there with `tunedeck train --resume RUN_DIR` "
    "(add the --nodes, --node-rank and --rendezvous flags, and start the other node as before, to resume on both)"
)
JOINED_MARK = "@tunedeck-joined"
"""Printed by each node's first rank once the process group stands: the launcher stops its rendezvous clock."""


def rendezvous_args(training: Any, local_addr: str | None = None) -> list[str]:
    """torchrun's flags for this node: c10d rendezvous at ``training.rendezvous``, hosted by node 0."""
    if training.nodes <= 1:
        return ["--standalone"]
    timeout = int(training.rendezvous_timeout)
    host_here = "true" if training.node_rank == 0 else "false"
    return [
        f"--nnodes={training.nodes}",
        f"--node-rank={training.node_rank}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={training.rendezvous}",
        f"--rdzv-id={RUN_ID}",
        f"--rdzv-conf=join_timeout={timeout},read_timeout={timeout},is_host={host_here}",
        "--max-restarts=0",
        *([f"--local-addr={local_addr}"] if local_addr else []),
    ]


def rendezvous_hint(training: Any) -> str:
    host, _, port = training.rendezvous.rpartition(":")
    return (
        f"every node must reach {host} on TCP port {port}: start node 0 there with the same --rendezvous, check "
        f"the address ({host} must be node 0's address on the link both computers share) and that the firewall "
        f"of node 0 lets port {port} in (and ports above it, which the training processes open)"
    )


@dataclass(frozen=True)
class Place:
    """Where this process stands: its global rank and world by (node rank, local rank), and its node."""

    rank: int
    world: int
    node: int
    nodes: int
    node_of_rank: tuple[int, ...]


def take_place(store: Any, torchrun_rank: int, world: int, local_rank: int) -> Place:
    """Every process posts (node rank, local rank) in the rendezvous store and takes its rank from the sorted list."""
    node = int(os.environ.get(NODE_RANK_ENV, "0"))
    store.set(f"{RUN_ID}/place/{torchrun_rank}", f"{node},{local_rank}")
    keys = [f"{RUN_ID}/place/{r}" for r in range(world)]
    store.wait(keys)
    places = sorted(tuple(int(v) for v in store.get(key).decode().split(",")) for key in keys)
    if len(set(places)) != len(places):
        clash = next(p for p in places if places.count(p) > 1)
        raise ConfigError(
            f"two computers both joined as --node-rank {clash[0]}",
            hint="give each computer its own --node-rank: 0 on the one that keeps the run folder, 1 on the other",
        )
    nodes = sorted({p[0] for p in places})
    if nodes != list(range(len(nodes))):
        raise ConfigError(
            f"the nodes joined as node ranks {nodes}", hint="number the computers 0, 1, ... with --node-rank"
        )
    return Place(places.index((node, local_rank)), world, node, len(nodes), tuple(p[0] for p in places))


def store_client(timeout_s: float) -> Any:
    """A new connection to the rendezvous store the launching torchrun agent hosts (``MASTER_ADDR:MASTER_PORT``)."""
    import torch.distributed as dist

    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def link_env(training: Any) -> dict[str, str]:
    """For several nodes: gloo's and NCCL's socket interface, where not set, is the one that routes to node 0, and
    torchrun announces this node by its address on that link (a host name may resolve elsewhere)."""
    if training.nodes <= 1:
        return {}
    host, _, port = training.rendezvous.rpartition(":")
    address = local_address_towards(host.strip("[]"), int(port))
    interface = interface_of(address)
    env = {LOCAL_ADDR_ENV: address}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if interface and not os.environ.get(name):
            env[name] = interface
            env[f"{name}_CHOSEN"] = "1"
    return env


def link_report(backend: str, node: int) -> str:
    """Which interface and address this node's process group uses, in words (printed by every node)."""
    peer = os.environ.get("MASTER_ADDR", "?")
    name = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    interface = os.environ.get(name)
    address = os.environ.get(LOCAL_ADDR_ENV, "?")
    if not interface:
        chooser = "NCCL picks it; NCCL_DEBUG=INFO names it" if backend == "nccl" else "gloo resolves the host name"
        return f"node {node}: {backend} over the interface {chooser} (address {address}); the store is at {peer}"
    why = "the route to node 0" if os.environ.get(f"{name}_CHOSEN") else "set"
    return f"node {node}: {backend} over {interface} ({name}, {why}), address {address}; the store is at {peer}"


def local_address_towards(host: str, port: int) -> str:
    """The local address the system routes to ``host`` from (no packet is sent)."""
    try:
        family = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family[0], socket.SOCK_DGRAM) as probe:
            probe.connect(family[4])
            return str(probe.getsockname()[0])
    except OSError:
        return host


def interface_of(address: str) -> str | None:
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address.split("%")[0] == address for entry in addresses):
            return str(name)
    return None


def this_machine_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) of every network interface that is up, loopback left out: where node 0 is reached."""
    import psutil

    stats = psutil.net_if_stats()
    found = []
    for name, addresses in psutil.net_if_addrs().items():
        if not stats.get(name) or not stats[name].isup:
            continue
        found += [
            (name, a.address) for a in addresses if a.family == socket.AF_INET and not a.address.startswith("127.")
        ]
    return found


def join_command(model: str, data: str, address: str, port: int, device: str = "auto") -> str:
    """What to type on the second computer to join node 0's run (node 0's settings apply there)."""
    import shlex

    words = ["tunedeck", "train", "--model", model, "--data", data]
    words += ["--device", device] if device != "auto" else []
    words += ["--nodes", "2", "--node-rank", "1", "--rendezvous", f"{address}:{port}"]
    return shlex.join(words)
