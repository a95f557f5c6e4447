"""``tunedeck bench --app-path``: the CLI and the window's run path in fresh processes, read back from their events."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.bench import app_path


def step(number: int, rate: float, memory: int, driver: int | None = None) -> dict:
    return {"kind": "StepMetrics", "step": number, "tokens": 4096, "tokens_per_s": rate, "loss": 1.0 / number,
            "memory_bytes": memory, "driver_memory_bytes": driver}  # fmt: skip


def test_a_paths_figures_come_from_its_events() -> None:
    events = [step(i, 100.0 if i <= app_path.TIMED_AFTER else 1000.0 + i, (5 + i % 2) * 2**30) for i in range(1, 21)]
    events[3]["driver_memory_bytes"] = 7 * 2**30
    events += [
        {"kind": "OomRecovered", "step": 2, "action": "retry"},
        {"kind": "SpeedChanged", "state": {"step_graphs": {"on": True}, "checkpointing": {"mode": "none"}}},
        {"kind": "RunFinished"},
    ]
    got = app_path.summary(events)
    assert got["tokens_per_s"] == 1016 and got["steps"] == 20 and got["tokens"] == 4096
    assert got["true_peak_gib"] == 6.0 and got["driver_peak_gib"] == 7.0
    assert got["memory_events"] == ["step 2: OomRecovered retry"] and got["outcome"] == "RunFinished"
    assert got["switches_on"] == ["step_graphs"]


def test_no_allocator_setting_reaches_the_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    environment = app_path.clean_environment()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in environment and "PYTORCH_ALLOC_CONF" not in environment


@pytest.mark.slow
def test_the_cli_and_the_window_path_run_in_fresh_processes(tmp_path: Path) -> None:
    """Two narrow layers on the CPU: the CLI stopped by Ctrl-C after its steps, the window's path stopped by its
    Stop call after a shortage in step 2 that costs one retry; a list of rows and a table."""
    out = tmp_path / "app_path.json"
    argv = ["--tiny", "--cap", "0", "--steps", "3", "--planned-steps", "8", "--rows", "16", "--tokens", "128",
            "--paths", "cli,app-oom", "--work", str(tmp_path / "work"), "--out", str(out)]  # fmt: skip
    assert app_path.main(argv) == 0
    rows = json.loads(out.read_text())
    assert [row["path"] for row in rows] == ["cli", "app-oom"]
    for row in rows:
        assert row["outcome"] == "RunFinished" and row["tokens"] == 128 and row["steps"] >= 3
        assert row["tokens_per_s"] > 0 and row["true_peak_gib"] > 0
    oom = rows[1]
    assert oom["fault"] == {"kind": "BenchFault", "step": 2, "real": False}
    assert oom["memory_events"] == ["step 2: OomRecovered retry"]
    table = out.with_suffix(".md").read_text()
    assert "| cli |" in table and "| app-oom |" in table and "step 2: OomRecovered retry" in table
