"""Where one training step's time goes, on the GPU and on the host: ``tunedeck bench --qlora --profile-dir DIR``.

A step can be slow for two different reasons. Either the GPU's kernels take that long, or the host takes that
long to queue them (Python, the dispatcher, compiled-graph wrappers, guard checks, library ops implemented in
Python) and the GPU waits. Faster kernels only help the first. One profiled step answers which it is:

* **GPU**: every kernel's time, summed by kind (GEMM, attention, 4-bit dequantize, fused Triton kernels, copies,
  other), and how long the GPU was busy at all (the union of kernel intervals, copies excluded: they run on a side
  stream beside the kernels) against the span from the first kernel to the last;
* **host**: the host operators' own time (the torch profiler's self CPU time), as a table, with the total.

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

__all__ = ["CATEGORIES", "kernel_category", "profile_step", "profiled", "timeline"]

CATEGORIES = ("gemm", "attention", "dequant", "triton", "copies", "other")
"""Kernel kinds, in the order reports list them."""
_ATTENTION = ("flash", "fmha", "sdpa", "cudnn", "attn")
_GEMM = ("nvjet", "gemm", "cutlass", "xmma", "splitk")


def kernel_category(name: str, trace_category: str) -> str:
    """The kind of one GPU trace event, from its name and its trace category."""
    if trace_category in ("gpu_memcpy", "gpu_memset"):
        return "copies"
    lowered = name.lower()
    if "dequant" in lowered:
        return "dequant"
    if any(word in lowered for word in _ATTENTION):
        return "attention"
    if any(word in lowered for word in _GEMM):
        return "gemm"
    if lowered.startswith("triton"):
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
    """Profile one call of ``step`` (after one untimed call) and write ``<label>_host_ops.txt`` under ``out``;
    returns :func:`timeline`'s summary with ``host_self_ms``, the host operators' own time."""
    prof = profiled(step)
    averages = prof.key_averages()
    out.mkdir(parents=True, exist_ok=True)
    table = averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70)
    (out / f"{label}_host_ops.txt").write_text(table, encoding="utf-8")
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        summary = timeline(json.loads(trace.read_text(encoding="utf-8")).get("traceEvents", []))
    summary["host_self_ms"] = round(sum(event.self_cpu_time_total for event in averages) / 1e3, 3)
    return summary
