"""Benchmark programs, run on a GPU machine; nothing in the training path imports them.

- engine.bench.speed: ``tunedeck bench`` (``python -m engine.bench``): stock transformers+PEFT against each
  speed optimization, on one GPU;
- engine.bench.long_context: how long a row each set of switches trains before memory runs out;
- engine.bench.qlora: ``tunedeck bench --qlora``, 4-bit 7-8B models under 8 and 24 GiB caps;
- engine.bench.multi_gpu: a step's time and memory over several GPUs under DDP;
- engine.bench.memory: what is alive at a step's memory peak, and where it was allocated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_report"]


def write_report(report: dict[str, Any], out: Path, table: str | None) -> None:
    """``report`` as JSON at ``out``, and ``table`` (Markdown) beside it, printed too; no table, no Markdown file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    if table is not None:
        out.with_suffix(".md").write_text(table, encoding="utf-8")
        print(table)
