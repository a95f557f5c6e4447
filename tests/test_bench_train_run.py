"""benchmarks/qlora_train_h200.py: `tunedeck train --qlora` on a generated model folder, read back from its events."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from helpers import benchmark_script


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return benchmark_script("qlora_train_h200")


def events(rates: list[float], resident: int) -> str:
    first = {"kind": "SpeedChanged", "step": 0, "state": {"checkpointing": {"mode": "none", "reason": "x"}}}
    later = {
        "kind": "SpeedChanged",
        "step": 5,
        "state": {
            "checkpointing": {"mode": "offloaded", "reason": "y"},
            "resident_layers": {"on": resident > 0, "layers": resident, "reason": "z"},
            "step_graphs": {"on": True, "reason": "automatic: on"},
            "fp8_base": {"on": False, "reason": "off"},
        },
    }
    steps = [
        {"kind": "StepMetrics", "step": i + 1, "loss": 10.0 - i, "tokens": 4096, "tokens_per_s": rate,
         "memory_bytes": (7 + i % 2) * 2**30}
        for i, rate in enumerate(rates)
    ]  # fmt: skip
    lines = [
        "loading...",
        json.dumps(first),
        *map(json.dumps, steps[:5]),
        json.dumps(later),
        *map(json.dumps, steps[5:]),
    ]
    return "\n".join([*lines, json.dumps({"kind": "RunFinished", "step": len(rates)}), "{not json"])


def test_summary_times_the_steps_after_warm_up_and_reads_the_settled_switches(bench: ModuleType) -> None:
    rates = [100.0] * 10 + [4096 / 0.4, 4096 / 0.5, 4096 / 0.3]
    got = bench.summary(bench.events_of(events(rates, resident=6)), "x\nUserWarning: Dynamo says\nwarnings.warn(\n")
    assert got["steps"] == 13 and got["tokens_per_s"] == round(4096 / 0.4) and got["ms_per_step"] == 400
    assert got["peak_gib"] == 8.0 and (got["first_loss"], got["final_loss"]) == (10.0, -2.0)
    assert got["resident_layers"] == 6 and got["checkpointing"] == "offloaded" and got["outcome"] == "RunFinished"
    assert got["switches_on"] == ["checkpointing", "resident_layers", "step_graphs"]
    assert got["warnings"] == ["UserWarning: Dynamo says", "warnings.warn("]


def test_runs_that_report_the_true_peak_record_it_and_the_driver_s_figure(bench: ModuleType) -> None:
    """Events with ``driver_memory_bytes`` carry the true peak in ``memory_bytes`` (reserved memory, step graphs'
    pool included); older logs (the test above) hold the allocated peak and get no ``true_peak_gib``."""
    lines = bench.events_of(events([4096 / 0.4] * 6, resident=0))
    steps = [e for e in lines if e.get("kind") == "StepMetrics"]
    for i, step in enumerate(steps):
        step["driver_memory_bytes"] = (9 + i % 2) * 2**30 if i else None
    got = bench.summary(lines, "")
    assert (got["peak_gib"], got["true_peak_gib"], got["driver_peak_gib"]) == (8.0, 8.0, 10.0)
    old = bench.summary(bench.events_of(events([4096 / 0.4] * 6, resident=0)), "")
    assert old["peak_gib"] == 8.0 and "true_peak_gib" not in old
    table = bench.markdown({"runs": [{**got, "shape": "llama-3.1-8b", "tokens": 4096, "cap_gib": 8.0}]})
    assert "largest per-step true peak the run reports: reserved memory" in table


def test_report_rebuilt_from_logs_sorts_runs_and_tables_them(bench: ModuleType, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    for cap, resident in ((8.0, 0), (24.0, 25), (12.0, 6)):
        (logs / f"llama-3.1-8b_4096_{cap}gib.log").write_text(events([4096 / 0.35] * 12, resident))
    out = tmp_path / "report.json"
    assert bench.main(["--from-logs", str(logs), "--gpu", "H200", "--date", "2026-12-02", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["cap_gib"] for r in report["runs"]] == [8.0, 12.0, 24.0] and report["gpu"] == "H200"
    table = out.with_suffix(".md").read_text()
    assert "| llama-3.1-8b | 4,096 | 24.0 | auto | 11,703 | 1.00 | 350 | 8.0 | 25 | on | 10.00 -> -1.000 | 0 |" in table
    trying = events([4096 / 0.35] * 12, 0).replace('"automatic: on"', '"automatic: trying; ..."')
    (logs / "llama-3.1-8b_16384_8.0gib.log").write_text(trying)
    (logs / "llama-3.1-8b_4096_8.0gib_auto-fused_kernels.log").write_text(events([4096 / 0.42] * 12, 0))
    assert bench.main(["--from-logs", str(logs), "--out", str(out)]) == 0
    table = out.with_suffix(".md").read_text()
    assert "| 16,384 | 8.0 | auto | 11,703 | 1.00 | 350 | 8.0 | 0 | no verdict |" in table
    # A switched-off run follows its automatic one, timed against it.
    rows = [line for line in table.splitlines() if "| 4,096 | 8.0 |" in line]
    got = [row.split(" | ")[3:6] for row in rows]
    assert got == [["auto", "11,703", "1.00"], ["auto-fused_kernels", "9,752", "0.83"]]


def test_variants_become_switch_flags(bench: ModuleType) -> None:
    assert bench.switch_flags("auto") == []
    assert bench.switch_flags("auto-fused_kernels") == ["--no-fused-kernels"]
    assert bench.switch_flags("auto+step_graphs") == ["--step-graphs"]
    assert bench.switch_flags("auto-fp8_base") == ["--fp8-base", "off"]
    assert bench.switch_flags("auto+fp8_base") == ["--fp8-base", "all"]
    assert bench.switch_flags("auto+fp8_base=recompute-dequant_once") == [
        "--fp8-base", "recompute", "--no-dequant-once"
    ]  # fmt: skip


def test_a_generated_folder_trains_through_the_command_line(bench: ModuleType, tmp_path: Path) -> None:
    """The whole path on the CPU: two narrow layers of the Llama shape, no cap, three steps."""
    out = tmp_path / "train.json"
    argv = ["--tiny", "--shapes", "llama-3.1-8b", "--caps", "0", "--tokens", "128", "--steps", "3", "--rows", "4"]
    paths = ["--work", str(tmp_path / "work"), "--logs", str(tmp_path / "logs"), "--out", str(out)]
    assert bench.main([*argv, *paths, "--off", "metadata_cache"]) == 0
    run, off = json.loads(out.read_text())["runs"]
    assert run["returncode"] == 0 and run["outcome"] == "RunFinished" and run["steps"] == 3, run
    assert run["tokens_per_s"] > 0 and run["cap_gib"] is None and run["checkpointing"] == "none"
    assert (run["variant"], off["variant"], off["outcome"]) == ("auto", "auto-metadata_cache", "RunFinished")
    assert "metadata_cache" in run["switches_on"] and "metadata_cache" not in off["switches_on"]
    assert (tmp_path / "work" / "llama-3.1-8b" / "model.safetensors.index.json").exists()
    assert (tmp_path / "logs" / "llama-3.1-8b_128_uncappedgib.log").read_text().count('"StepMetrics"') == 3


def test_a_run_planned_longer_is_stopped_after_the_timed_steps(bench: ModuleType, tmp_path: Path) -> None:
    """``--planned-steps``: the run is configured as a long one (its choices weigh 50 steps) and stopped with
    Ctrl-C once the timed steps are reported, as a user stops it."""
    out = tmp_path / "train.json"
    argv = ["--tiny", "--shapes", "llama-3.1-8b", "--caps", "0", "--tokens", "128", "--steps", "2", "--rows", "4"]
    paths = ["--work", str(tmp_path / "work"), "--logs", str(tmp_path / "logs"), "--out", str(out)]
    assert bench.main([*argv, *paths, "--planned-steps", "50"]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["outcome"] == "RunFinished" and 2 <= run["steps"] < 50, run
    log = (tmp_path / "logs" / "llama-3.1-8b_128_uncappedgib.log").read_text()
    started = next(json.loads(line) for line in log.splitlines() if '"RunStarted"' in line)
    assert started["total_steps"] == 50, started


def test_the_report_names_the_training_libraries_installed(bench: ModuleType) -> None:
    import importlib.metadata

    versions = bench.library_versions()
    assert versions.startswith(f"torch {importlib.metadata.version('torch')}, transformers ")
    assert f"peft {importlib.metadata.version('peft')}" in versions
