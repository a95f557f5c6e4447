"""Where one training step's time goes, on the GPU and on the host: ``tunedeck bench --qlora --profile-dir DIR``.

A step can be slow for two different reasons. Either the GPU's kernels take that long, or the host takes that
long to queue them (Python, the dispatcher, compiled-graph wrappers, guard checks, library ops implemented in
Python) and the GPU waits. Faster kernels only help the first. One profiled step answers which it is:

* **GPU**: every kernel's time, summed by kind (GEMM, attention, 4-bit dequantize, fused Triton kernels, copies,
  other), and how long the GPU was busy at all (the union of kernel intervals, copies excluded: they run on a side
  stream beside the kernels) against the span from the first kernel to the last;
* **host**: the host operators' own time (the torch profiler's self CPU time), as a table, with the total;
* **kernels and gaps**: the kernels by total time, and the longest stretches in which the GPU ran nothing, each
  with the kernels on either side and the host operators running meanwhile (what kept the GPU waiting).

Compare the busy time with the step time and the host's queueing time (``host_ms`` in the bench rows): a GPU busy
for most of the step sets the pace; a host that needs nearly the whole step to queue it does.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = ["CATEGORIES", "gaps", "kernel_category", "kernel_table", "profile_step", "profiled", "timeline"]

CATEGORIES = ("gemm", "attention", "dequant", "triton", "copies", "other")
"""Kernel kinds, in the order reports list them."""
_ATTENTION = ("flash", "fmha", "sdpa", "cudnn", "attn")
_GEMM = ("nvjet", "gemm", "cutlass", "xmma", "splitk")
_DEQUANT = ("dequant", "four_bit_decode")
"""bitsandbytes' kernels, and TuneDeck's 4-bit decode kernel (engine.speed.four_bit_weights)."""
_OWN_TRITON = ("cross_entropy_grad",)
"""TuneDeck's hand-written Triton kernels outside the weights' (engine.speed.loss_kernel)."""


def kernel_category(name: str, trace_category: str) -> str:
    """The kind of one GPU trace event, from its name and its trace category."""
    if trace_category in ("gpu_memcpy", "gpu_memset"):
        return "copies"
    lowered = name.lower()
    if any(word in lowered for word in _DEQUANT):
        return "dequant"
    if any(word in lowered for word in _ATTENTION):
        return "attention"
    if any(word in lowered for word in _GEMM):
        return "gemm"
    if lowered.startswith("triton") or lowered in _OWN_TRITON:
        return "triton"
    return "other"


def timeline(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """GPU time by kind, busy time and span (milliseconds) from chrome-trace events (``ts``/``dur`` in µs)."""
    by_kind: dict[str, float] = defaultdict(float)
    intervals = []
    for event in events:
        if event.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in event:
            continue
        kind = kernel_category(str(event.get("name", "")), event["cat"])
        by_kind[kind] += event["dur"] / 1e3
        if event["cat"] != "gpu_memcpy":
            intervals.append((float(event["ts"]), float(event["ts"]) + float(event["dur"])))
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    span = (max(stop for _, stop in intervals) - min(start for start, _ in intervals)) if intervals else 0.0
    return {
        "gpu_ms": {kind: round(by_kind.get(kind, 0.0), 3) for kind in CATEGORIES},
        "gpu_busy_ms": round(busy / 1e3, 3),
        "gpu_span_ms": round(span / 1e3, 3),
    }


def _kernels(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace's GPU kernels and memsets (what occupies the GPU's engines for compute), by start time."""
    wanted = [e for e in events if e.get("cat") in ("kernel", "gpu_memset") and "dur" in e]
    return sorted(wanted, key=lambda e: float(e["ts"]))


def kernel_table(events: Iterable[dict[str, Any]], limit: int = 40) -> str:
    """The ``limit`` kernels with the most GPU time, summed by name: total ms, calls and kind."""
    total: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    kinds: dict[str, str] = {}
    for event in _kernels(events):
        name = str(event.get("name", ""))
        total[name] += float(event["dur"]) / 1e3
        calls[name] += 1
        kinds[name] = kernel_category(name, event["cat"])
    lines = [f"{'ms':>9} {'calls':>6}  {'kind':<9} kernel"]
    for name in sorted(total, key=total.__getitem__, reverse=True)[:limit]:
        lines.append(f"{total[name]:9.3f} {calls[name]:6d}  {kinds[name]:<9} {name[:150]}")
    return "\n".join(lines)


def gaps(events: list[dict[str, Any]], limit: int = 15, shortest_us: float = 50.0) -> list[dict[str, Any]]:
    """The ``limit`` longest stretches (at least ``shortest_us``) in which no kernel ran, longest first: where
    (ms from the first kernel), how long, the kernels before and after, and the longest host operators that
    overlap it."""
    kernels = _kernels(events)
    if not kernels:
        return []
    first = float(kernels[0]["ts"])
    found: list[dict[str, Any]] = []
    end, before = first, ""
    for event in kernels:
        start = float(event["ts"])
        if start - end >= shortest_us:
            found.append({"at_ms": (end - first) / 1e3, "ms": (start - end) / 1e3, "before": before,
                          "after": str(event.get("name", "")), "span": (end, start)})  # fmt: skip
        if start + float(event["dur"]) > end:
            end, before = start + float(event["dur"]), str(event.get("name", ""))
    found = sorted(found, key=lambda gap: gap["ms"], reverse=True)[:limit]
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e]
    for gap in found:
        low, high = gap.pop("span")
        over = [e for e in host if float(e["ts"]) < high and float(e["ts"]) + float(e["dur"]) > low]
        longest = sorted(over, key=lambda e: float(e["dur"]), reverse=True)[:3]
        gap["host"] = [str(e.get("name", "")) for e in longest]
    return found


def gap_lines(found: list[dict[str, Any]]) -> str:
    lines = [f"{'at ms':>9} {'gap ms':>8}  after kernel -> before kernel | host operators meanwhile"]
    for gap in found:
        lines.append(f"{gap['at_ms']:9.3f} {gap['ms']:8.3f}  {gap['before'][:60]} -> {gap['after'][:60]} "
                     f"| {', '.join(name[:50] for name in gap['host'])}")  # fmt: skip
    return "\n".join(lines)


def profiled(step: Callable[[], object], record_shapes: bool = False) -> Any:
    """The torch profiler over one call of ``step``, after one untimed call (GPU kernels too where there is one)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    step()
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    return prof


def profile_step(step: Callable[[], object], out: Path, label: str) -> dict[str, Any]:
    """Profile one call of ``step`` (after one untimed call) and write ``<label>_host_ops.txt`` and
    ``<label>_kernels.txt`` (kernels by time, then the GPU's longest idle gaps) under ``out``; returns
    :func:`timeline`'s summary with ``host_self_ms``, the host operators' own time, and ``gaps``, the five longest
    idle gaps."""
    prof = profiled(step)
    averages = prof.key_averages()
    out.mkdir(parents=True, exist_ok=True)
    table = averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
    (out / f"{label}_host_ops.txt").write_text(table, encoding="utf-8")
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text(encoding="utf-8")).get("traceEvents", [])
    summary = timeline(events)
    found = gaps(events)
    kernels = f"{kernel_table(events)}\n\nThe GPU's longest idle gaps\n{gap_lines(found)}\n"
    (out / f"{label}_kernels.txt").write_text(kernels, encoding="utf-8")
    summary["gaps"] = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in g.items()} for g in found[:5]]
    summary["host_self_ms"] = round(sum(event.self_cpu_time_total for event in averages) / 1e3, 3)
    return summary
