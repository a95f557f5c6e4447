"""What is alive at a training step's memory peak, and where it was allocated (``tunedeck bench --memory-variants``).

A peak figure says how much; to lower it one needs to know what. This records the CUDA caching allocator's trace
over one step (``torch.cuda.memory._record_memory_history``), replays it to find the moment the live bytes peak,
and groups what is alive at that moment by the first stack frame outside torch itself (a line of transformers,
peft, TuneDeck, or a compiled graph). Memory allocated before the step (weights, LoRA, optimizer state, the
offload ring) is one line of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["allocation_site", "live_at_peak", "peak_table", "record_peak"]

MIB = 2**20
TORCH_PARTS = ("/torch/", "<frozen", "/contextlib.py", "/functools.py")


def allocation_site(frames: Iterable[Mapping[str, Any]]) -> str:
    """``file:line function`` of the first frame outside torch and the standard library (innermost first)."""
    frames = list(frames)
    for frame in frames:
        filename = str(frame.get("filename", ""))
        if not any(part in filename for part in TORCH_PARTS):
            return f"{Path(filename).name}:{frame.get('line', '?')} {frame.get('name', '?')}"
    return "torch internals" if frames else "unknown (no stack recorded)"


def _peak_index(events: list[Mapping[str, Any]]) -> int:
    current = peak = 0
    index = -1
    live: dict[int, int] = {}
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            current += event["size"]
            if current > peak:
                peak, index = current, i
        elif event["action"] == "free_completed":
            current -= live.pop(event["addr"], 0)
    return index


def live_at_peak(events: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The allocations alive when the bytes allocated during the trace peaked (two passes over the trace)."""
    events = [e for e in events if e.get("action") in ("alloc", "free_completed")]
    stop = _peak_index(events)
    live: dict[int, Mapping[str, Any]] = {}
    for event in events[: stop + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        else:
            live.pop(event["addr"], None)
    return list(live.values())


def peak_table(events: Iterable[Mapping[str, Any]], before_bytes: int, peak_bytes: int, rows: int = 30) -> str:
    """A text table: what is alive at the peak, summed by allocation site, largest first."""
    sites: dict[str, list[int]] = {}
    for event in live_at_peak(events):
        entry = sites.setdefault(allocation_site(event.get("frames") or []), [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    in_step = sum(size for size, _ in sites.values())
    lines = [
        f"peak allocated {peak_bytes / MIB:,.0f} MiB = {before_bytes / MIB:,.0f} MiB allocated before the step "
        f"+ {in_step / MIB:,.0f} MiB allocated in it and alive at its peak",
        "",
        f"{'MiB':>10} {'tensors':>8}  allocated at",
    ]
    for site, (size, count) in sorted(sites.items(), key=lambda item: -item[1][0])[:rows]:
        lines.append(f"{size / MIB:10,.1f} {count:8d}  {site}")
    return "\n".join(lines) + "\n"


def record_peak(step: Callable[[], object], out: Path, label: str) -> dict[str, Any]:
    """Run ``step`` once under the allocator's trace and write ``<label>_memory_peak.txt`` under ``out``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][torch.cuda.current_device()]
    out.mkdir(parents=True, exist_ok=True)
    table = peak_table(events, before, torch.cuda.max_memory_allocated())
    (out / f"{label.replace('+', '_')}_memory_peak.txt").write_text(table, encoding="utf-8")
    return {}
