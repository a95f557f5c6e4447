"""Each computer's share of a run over several: its devices, how long it works on a step, its memory, the slowest.

The figures ride on what every step already carries: the step's one small all-reduce on the gloo group holds every
rank's peak memory and busy time (:meth:`~engine.run.ranks.Ranks.reduce_step_figures`, 2W float64 values added), so
every rank holds them all after each step at no extra round trip. The devices are gathered once, before the first
step (one ``all_gather_object`` of a short string per rank). The first rank of each node then turns a step's rank
figures into a :class:`~engine.events.NodeFigures` event, a pure regrouping by node, and prints it after the step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.events import Event, NodeFigures, StepMetrics

if TYPE_CHECKING:
    import torch

    from engine.distributed.nodes import Place
    from engine.run.ranks import Ranks

CPU_INFO = Path("/proc/cpuinfo")


def device_name(device: torch.device) -> str:
    """What trains on this rank, in words: the GPU's name, or the CPU's model."""
    if device.type == "cuda":
        import torch

        return str(torch.cuda.get_device_name(device))
    model = cpu_model()
    return f"CPU ({model})" if model else "CPU"


def cpu_model() -> str:
    """The processor's model name where the system tells it (Linux), else ""."""
    try:
        lines = CPU_INFO.read_text().splitlines()
    except OSError:
        import platform

        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def node_devices(names: list[str], node_of_rank: Sequence[int]) -> list[str]:
    """Each node's devices from its ranks' names: "NVIDIA H100 80GB HBM3", "2 × NVIDIA H100 80GB HBM3"."""
    nodes = max(node_of_rank) + 1
    described = []
    for node in range(nodes):
        counts = Counter(name for name, owner in zip(names, node_of_rank, strict=True) if owner == node)
        described.append(" + ".join(name if n == 1 else f"{n} × {name}" for name, n in counts.items()))
    return described


def gather_devices(ranks: Ranks, place: Place, device: torch.device) -> list[str]:
    """Every node's devices, known on every rank (a collective on the control group)."""
    import torch.distributed as dist

    names: list[Any] = [None] * ranks.world
    dist.all_gather_object(names, device_name(device), group=ranks.control_group)
    return node_devices([str(name) for name in names], place.node_of_rank)


def node_figures(step: StepMetrics, node_of_rank: Sequence[int], devices: list[str]) -> NodeFigures | None:
    """The step's rank figures regrouped by node (None without them): a node's time is its slowest rank's, its memory
    its largest rank's."""
    busy, memory = step.rank_busy_s, step.rank_memory_bytes
    if busy is None or memory is None or len(busy) != len(node_of_rank):
        return None
    times = [max(t for t, n in zip(busy, node_of_rank, strict=True) if n == node) for node in range(len(devices))]
    peaks = [max(m for m, n in zip(memory, node_of_rank, strict=True) if n == node) for node in range(len(devices))]
    slowest = max(range(len(times)), key=lambda node: times[node])
    return NodeFigures(step.step, devices, times, peaks, slowest, times[slowest] - min(times))


def figures_after(node_of_rank: Sequence[int], devices: list[str]) -> Any:
    """For the rank that prints a node's events: each step followed by its node figures."""

    def after(event: Event) -> list[Event]:
        figures = node_figures(event, node_of_rank, devices) if isinstance(event, StepMetrics) else None
        return [figures] if figures is not None else []

    return after


def slower_line(figures: NodeFigures) -> str:
    """Which node is slower and by how much, in words ("" with one node or when they work alike to the ms)."""
    fastest = min(figures.step_time_s)
    if len(figures.step_time_s) < 2 or figures.slower_by_s < 0.0005:
        return ""
    share = f" ({figures.slower_by_s / fastest:.0%})" if fastest > 0 else ""
    return f"node {figures.slowest} is slower: {figures.slower_by_s:.2f} s more a step{share}"


def nodes_line(figures: NodeFigures) -> str:
    """The step's figures per node in one line, for a terminal."""
    parts = [
        f"node {node}: {device}, {time_s:.2f} s/step, {memory / 2**30:.2f} GiB"
        for node, (device, time_s, memory) in enumerate(
            zip(figures.devices, figures.step_time_s, figures.memory_bytes, strict=True)
        )
    ]
    slower = slower_line(figures)
    return f"step {figures.step}: " + "; ".join(parts) + (f"; {slower}" if slower else "")
