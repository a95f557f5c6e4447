"""benchmarks/short_run_h200.py: short `tunedeck train` runs in fresh processes, timed from their JSON events."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from helpers import benchmark_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return benchmark_script("short_run_h200")


def timed_events(step_ms: list[float], started_at: float = 5.0, every: float = 0.5) -> list[tuple[float, dict]]:
    state = {"fused_kernels": {"on": False, "reason": "automatic: off for a 20-step run: compiling costs about 27 s"}}
    events = [
        (started_at, {"kind": "RunStarted", "train_rows": 21}),
        (started_at, {"kind": "SpeedChanged", "step": 0, "state": state}),
    ]
    for i, ms in enumerate(step_ms):
        step = {"kind": "StepMetrics", "step": i + 1, "step_time_s": ms / 1e3, "loss": 5.0 - i}
        events.append((started_at + 1 + every * i, step))
    return [*events, (started_at + 2 + every * len(step_ms), {"kind": "RunFinished", "wall_time_s": 12.5})]


def test_summary_times_the_first_step_and_the_first_fast_one(bench: ModuleType) -> None:
    got = bench.summary(timed_events([4000.0, 900.0, 12.0, 10.0, 9.0, 10.0, 11.0]))
    assert got["steps"] == 7 and got["train_rows"] == 21 and got["outcome"] == "RunFinished"
    assert got["first_step_s"] == 6.0 and got["fast_step_s"] == 7.0 and got["fast_after_start_s"] == 2.0
    assert got["settled_step_ms"] == 10.0 and got["run_wall_s"] == 12.5 and got["step_ms"][0] == 4000.0
    assert not got["fused_kernels"]["on"] and got["step_graphs"] == {}
    lines = [(1.0, "loading"), (2.0, json.dumps({"kind": "RunStarted"})), (3.0, "{broken")]
    assert bench.events_of(lines) == [(2.0, {"kind": "RunStarted"})]


def test_report_sets_each_automatic_run_against_the_all_off_run_of_its_length(bench: ModuleType) -> None:
    def record(planned: object, wall: float, ms: list[float]) -> dict:
        return {"label": planned.label, "variant": planned.variant, "steps_asked": planned.steps, "wall_s": wall,
                **bench.summary(timed_events(ms))}  # fmt: skip

    off, cold, warm, _, long_auto = bench.plan(long=True)
    assert (cold.home, warm.home, cold.label) == ("auto", "auto", "b: 20 steps, automatic, cold cache")
    runs = [record(off, 40.0, [158.0] * 20), record(cold, 30.0, [60.0] * 20), record(warm, 20.0, [50.0] * 20),
            record(long_auto, 25.0, [20.0] * 210)]  # fmt: skip
    rows = bench.ratios(runs)
    assert [r["label"] for r in rows] == [cold.label, warm.label]  # no all-off run of 210 steps to compare with
    assert rows[0]["wall_s"] == 0.75 and rows[1]["wall_s"] == 0.5 and rows[1]["settled_step_ms"] == 0.32
    table = bench.markdown({"gpu": "H200", "runs": runs, "ratios": rows, "notes": ["a note"]})
    assert "| a: 20 steps, all off | 40.0 | 12.5 | 6.0 | 6.0 | 1.0 | 158.0 | off | - |" in table
    assert "| c: 20 steps, automatic, warm cache | 0.5 | 1.0 | 1.0 | 0.32 |" in table
    assert "compiling costs about 27 s" in table and table.rstrip().endswith("a note")


def test_all_off_runs_turn_every_switch_off(bench: ModuleType) -> None:
    flags = bench.off_flags()
    assert {"--no-fused-kernels", "--no-step-graphs", "--no-metadata-cache", "--no-fused-loss"} <= set(flags)
    assert flags[flags.index("--checkpointing") + 1] == "none" and flags[flags.index("--moe-routing") + 1] == "stock"
    from engine.cli.train import train_parser

    train_parser().parse_args(["--data", "x.jsonl", *flags])  # every flag exists


def test_the_tiny_record_runs_tunedeck_train_three_times_on_the_cpu(bench: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "out" / "short.json"
    assert bench.main(["--tiny", "--work", str(tmp_path / "work"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert [r["label"] for r in runs] == ["a: 3 steps, all off", "b: 3 steps, automatic, cold cache",
                                          "c: 3 steps, automatic, warm cache"]  # fmt: skip
    assert all(r["returncode"] == 0 and r["outcome"] == "RunFinished" and r["steps"] == 3 for r in runs)
    assert all(0 < r["first_step_s"] <= r["wall_s"] and r["fast_step_s"] is not None for r in runs)
    assert runs[0]["fused_kernels"]["reason"].startswith("switched off")
    assert len(report["ratios"]) == 2 and out.with_suffix(".md").exists()
    assert (tmp_path / "work" / "homes" / "auto" / "runs.sqlite3").exists()  # each run used the record's data folder
