"""Benchmark programs, run on a GPU machine; nothing in the training path imports them.

- engine.bench.command: ``tunedeck bench`` (``python -m engine.bench``), which runs one of those below;
- engine.bench.speed: stock transformers+PEFT against each speed optimization, on one GPU;
- engine.bench.app_path: ``tunedeck bench --app-path``, the 8B QLoRA row through the CLI and the window's run path;
- engine.bench.long_context: how long a row each set of switches trains before memory runs out;
- engine.bench.qlora: ``tunedeck bench --qlora``, 4-bit 7-8B models under 8 and 24 GiB caps;
- engine.bench.multi_gpu: a step's time and memory over several GPUs under DDP;
- engine.bench.memory: what is alive at a step's memory peak, and where it was allocated.
"""

from __future__ import annotations

import importlib.metadata
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["gpu_environment", "median_ms", "report_main", "write_report"]


def median_ms(fn: Callable[[], object], reps: int = 20, warmup: int = 3, cuda: bool = True) -> float:
    """Median time of one call of ``fn`` in ms, after ``warmup`` calls: GPU time from CUDA events around each call,
    or the host clock (``cuda`` False)."""
    import torch

    for _ in range(warmup):
        fn()
    times: list[float] = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def gpu_environment(packages: tuple[str, ...]) -> dict[str, str]:
    """Where a record ran: the GPU's name (``CPU`` without one), today's date and the installed versions of
    ``packages`` (those not installed are left out)."""
    import torch

    versions = []
    for name in packages:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return {"gpu": gpu, "date": time.strftime("%Y-%m-%d"), "versions": ", ".join(versions)}


def write_report(report: dict[str, Any], out: Path, table: str | None) -> None:
    """``report`` as JSON at ``out``, and ``table`` (Markdown) beside it, printed too; no table, no Markdown file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    if table is not None:
        out.with_suffix(".md").write_text(table, encoding="utf-8")
        print(table)


def report_main(
    parse_args: Callable[[list[str] | None], Any],
    measure: Callable[[Any], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
) -> Callable[[list[str] | None], int]:
    """A benchmark script's ``main``: parse its arguments, measure, write the report to ``--out`` with its table."""

    def main(argv: list[str] | None = None) -> int:
        args = parse_args(argv)
        report = measure(args)
        write_report(report, args.out, table(report))
        return 0

    return main
