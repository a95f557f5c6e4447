"""The speed benchmark's report: the planner's prediction beside each measured peak."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.bench.speed import DENSE_SHAPES, markdown, planned_peak_gib
from engine.hardware.shapes import ModelShape, load_shape

REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "speed_h200.json"


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen3-0.6b"])
def test_the_bench_shapes_are_the_planners(name: str) -> None:
    """The prediction is only worth its column if the bench's model is the shape the planner knows by name."""
    bench, builtin = ModelShape.from_config_dict(DENSE_SHAPES[name], name), load_shape(name)
    assert bench.total_params() == builtin.total_params() and bench.q_dim == builtin.q_dim
    assert bench.tied_embeddings == builtin.tied_embeddings


def test_the_table_shows_the_planned_peak_where_a_row_has_one() -> None:
    report = json.loads(REPORT.read_text(encoding="utf-8"))
    rows = {(r["model"], r["variant"]): r for r in report["dense"] if "state" in r and r["model"] == "llama-3.2-1b"}
    offloaded, chunked = (
        rows["llama-3.2-1b", "all_on+offloaded_ckpt"],
        rows["llama-3.2-1b", "all_on+offloaded_ckpt+chunked_mlp"],
    )
    plan = {key: planned_peak_gib("llama-3.2-1b", rows[key]["state"], 16384, (9, 0)) for key in rows}
    assert plan["llama-3.2-1b", "all_on+offloaded_ckpt+chunked_mlp"] < plan["llama-3.2-1b", "all_on+offloaded_ckpt"]
    assert plan["llama-3.2-1b", "all_on+offloaded_ckpt"] < plan["llama-3.2-1b", "all_on"]
    offloaded["planned_peak_gib"] = plan["llama-3.2-1b", "all_on+offloaded_ckpt"]
    text = markdown(report)
    assert "| peak GiB (reserved) | allocated GiB | planned GiB |" in text
    # rows measured before the true peak: no reserved peak, their peak_vram_gib is the allocated one
    assert f"| - | {offloaded['peak_vram_gib']:.2f} | {offloaded['planned_peak_gib']:.2f} |" in text
    assert f"| - | {chunked['peak_vram_gib']:.2f} | - |" in text  # measured before the planned column existed


def test_the_table_shows_the_true_peak_beside_the_allocated_one() -> None:
    """A step-graph row: its pool is reserved, not allocated, between replays; the peak column is the reserved."""
    report = json.loads(REPORT.read_text(encoding="utf-8"))
    row = next(r for r in report["dense"] if r.get("variant") == "all_on" and "ms_per_step" in r)
    row.update(peak_vram_gib=78.9, true_peak_gib=78.9, allocated_peak_gib=2.6, reserved_gib=78.9)
    assert f"| {row['tokens_per_s']:,.0f} | 78.90 | 2.60 |" in markdown(report)
