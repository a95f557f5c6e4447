"""The one summary of a run that every page shows (engine.run.summary) and its time estimate (engine.run.estimate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import events as ev
from engine.run.estimate import (
    NO_ESTIMATE,
    MeasuredRow,
    TimeEstimate,
    before_start,
    describe_time,
    during_run,
    format_duration,
    gpu_class_of,
)
from engine.run.summary import (
    STOPPED_MESSAGE,
    RunSummary,
    describe,
    measured_rows,
    state_of_record,
    summarize,
    summary_of_folder,
)

GIB = 1 << 30


def step(n: int, *, total: int = 10, tokens: int = 1000, seconds: float = 0.5, memory: float = 1.0) -> ev.StepMetrics:
    return ev.StepMetrics(n, total, 0.1 * n, 2.0 / n, 1e-3, 1.0, tokens, tokens // 4, seconds, tokens / seconds,
                          int(memory * GIB))  # fmt: skip


def started(run_dir: str, total: int = 10, start: int = 0) -> ev.RunStarted:
    return ev.RunStarted(run_dir, "cpu", "float32", total, start, 100, 2, 10, 0.98, 1000, 100_000)


ROWS = (
    MeasuredRow("cpu", "", "demo", False, 1024, 2048.0),
    MeasuredRow("cpu", "", "demo", False, 1024, 1024.0),
    MeasuredRow("cpu", "", "demo", False, 4096, 9000.0),
    MeasuredRow("cpu", "", "demo", True, 1024, 100.0),
    MeasuredRow("cpu", "", "demo", False, 1024, 10.0, "dpo"),
    MeasuredRow("cpu", "", "other", False, 1024, 10.0),
    MeasuredRow("rtx-consumer", "RTX 4090", "demo", False, 1024, 50_000.0),
    MeasuredRow("rtx-consumer", "RTX 3050", "demo", False, 1024, 5_000.0),
)


@pytest.mark.parametrize(
    ("case", "gpu_class", "gpu_name", "model", "qlora", "planner", "expected_seconds", "source"),
    [
        # the two 1,024-token LoRA runs of the model here: steps of 0.5 and 1 s (median 0.75 s); the DPO run's
        # steps are its own
        ("nearest row length, same settings", "cpu", "", "demo", False, None, 60 * 0.75, "measured"),
        ("QLoRA runs only match QLoRA", "cpu", "", "demo", True, None, 60 * 1024 / 100, "measured"),
        ("the same card before the class", "rtx-consumer", "RTX 4090", "demo", False, None, 60 * 1024 / 50_000,
         "measured"),
        ("another card of the class", "rtx-consumer", "RTX 4080", "demo", False, None,
         60 * (1024 / 50_000 + 1024 / 5_000) / 2, "measured"),
        ("no run of this model: the planner", "rtx-consumer", "RTX 4090", "qwen", False, 2048.0, 30.0, "planner"),
        # no run here, but TuneDeck's own H200 rows of this model: 169 ms a 16,384-token step, scaled to 1,024 tokens
        ("TuneDeck's rows of the GPU class", "hopper", "NVIDIA H200", "Qwen/Qwen3-0.6B", False, 1e9,
         60 * 1024 / (16_384 / 0.169), "measured"),
        ("the hub id names the shape", "hopper", "NVIDIA H100 80GB HBM3", "meta-llama/Llama-3.1-8B-Instruct", True,
         None, 60 * 1024 / 12_897, "measured"),
        ("no run and no planner figure", "cpu", "", "qwen", False, None, None, "none"),
    ],
)  # fmt: skip
def test_the_estimate_before_start_comes_from_runs_measured_here_first(
    case: str, gpu_class: str, gpu_name: str, model: str, qlora: bool, planner: float | None,
    expected_seconds: float | None, source: str,
) -> None:  # fmt: skip
    estimate = before_start(steps=60, tokens_per_step=1024, gpu_class=gpu_class, gpu_name=gpu_name, model=model,
                            qlora=qlora, rows=ROWS, planner_tokens_per_s=planner)  # fmt: skip
    assert estimate.source == source, case
    if case.startswith("nearest"):
        dpo = before_start(steps=60, tokens_per_step=1024, gpu_class=gpu_class, gpu_name=gpu_name, model=model,
                           qlora=qlora, rows=ROWS, planner_tokens_per_s=planner, method="dpo")  # fmt: skip
        assert dpo.seconds == pytest.approx(60 * 1024 / 10.0), "a DPO run's estimate comes from DPO runs"
    assert estimate.seconds == (pytest.approx(expected_seconds) if expected_seconds is not None else None), case
    if "TuneDeck" in case:
        assert estimate.basis == "from TuneDeck's measured steps on this GPU class"


def test_the_runs_own_pace_replaces_the_estimate_after_the_first_steps() -> None:
    before = TimeEstimate(100.0, "from 2 earlier runs of this model here", "measured")
    assert during_run(before, 2, 10, 2, (5.0, 1.0)) is before, "two steps are not enough to go on"
    live = during_run(before, 3, 10, 3, (5.0, 1.0, 1.0))
    assert live is not None and live.source == "steps"
    assert live.left_s == pytest.approx(7 * 1.0), "the first step's warm-up is left out of the pace"
    assert live.seconds == pytest.approx(3 * 1.0 + 7 * 1.0)
    assert live.basis == "from its first 3 steps"
    later = during_run(live, 9, 10, 30, (2.0,) * 20)
    assert later is not None and later.left_s == pytest.approx(2.0) and later.basis == "from its last 20 steps"


@pytest.mark.parametrize(
    ("estimate", "first", "took", "active", "text"),
    [
        (TimeEstimate(240.0, "from 2 earlier runs of this model here", "measured"), None, None, False,
         "training takes about 4 min (from 2 earlier runs of this model here)"),
        (NO_ESTIMATE, None, None, True, "training time: known after the first steps"),
        (TimeEstimate(100.0, "from its last 5 steps", "steps", left_s=65.0), None, None, True,
         "about 1 min 05 s left (from its last 5 steps)"),
        (TimeEstimate(100.0, "from its last 5 steps", "steps", left_s=0.0),
         TimeEstimate(240.0, "from 2 earlier runs of this model here", "measured"), 260.0, False,
         "estimated 4 min (from 2 earlier runs of this model here), training took 4 min 20 s"),
        (NO_ESTIMATE, None, 42.0, False, "training took 42 s"),
        (TimeEstimate(100.0, "from its last 5 steps", "steps", left_s=0.0), None, None, False, ""),
    ],
)  # fmt: skip
def test_time_in_words(
    estimate: TimeEstimate, first: TimeEstimate | None, took: float | None, active: bool, text: str
) -> None:
    assert describe_time(estimate, first, took, active) == text


@pytest.mark.parametrize(("seconds", "text"), [(0.4, "0 s"), (59, "59 s"), (60, "1 min"), (260, "4 min 20 s"),
                                               (3900, "1 h 05 min")])  # fmt: skip
def test_durations(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def fold(events: list[object], clock: list[float] | None = None) -> RunSummary:
    planned = TimeEstimate(30.0, "from the planner's figure for this card", "planner")
    summary = RunSummary(state="loading", predicted_peak_bytes=GIB // 10, estimate=planned, first_estimate=planned)
    for index, event in enumerate(events):
        summary = summarize(summary, event, now=None if clock is None else clock[index])
    return summary


def test_a_runs_events_fold_into_its_state_peak_speed_and_time(tmp_path: Path) -> None:
    run = str(tmp_path)
    events: list[object] = [started(run), step(1, seconds=2.0, memory=5.0), step(2, memory=5.125), step(3),
                            ev.RunPaused(3), ev.RunResumed(3), step(4)]  # fmt: skip
    clock = [0.0, 1, 2, 3, 10.0, 70.0, 71]
    summary = fold(events, clock)
    assert summary.state == "running" and summary.step == 4 and summary.paused_seconds == 60.0
    assert summary.peak_memory_bytes == int(5.125 * GIB)
    assert summary.tokens_per_s == pytest.approx(4000 / 3.5)
    texts = describe(summary)
    assert texts.peak == "5.12 GiB (process memory)" and texts.planned == "0.10 GiB"
    assert texts.speed == "1,143 tokens/s" and texts.progress == "step 4 of 10"
    assert "peak memory measured: 5.12 GiB (process memory) · predicted by the plan: 0.10 GiB" in texts.line()
    finished = summarize(summary, ev.RunFinished(4, run, run + "/adapter", 0.5, None, 95.0, cancelled=True), now=80)
    assert finished.state == "stopped" and finished.training_seconds == 35.0, "pauses are not training time"
    assert describe(finished).time == "estimated 30 s (from the planner's figure for this card), training took 35 s"


def test_a_past_run_read_from_its_folder_reads_as_the_live_run_did(tmp_path: Path) -> None:
    steps = [step(1, seconds=2.0, memory=5.0), step(2, memory=5.125), step(3)]
    with (tmp_path / "metrics.jsonl").open("w", encoding="utf-8") as handle:
        for metrics in steps:
            record = metrics.to_dict()
            record.pop("kind")
            handle.write(json.dumps(record) + "\n")
        handle.write('{"step": 4, "loss"')  # a torn last line
    live = fold([started(str(tmp_path)), *steps, ev.RunFinished(3, str(tmp_path), "", 0.6, None, 4.0)])
    past = summary_of_folder(tmp_path, "finished", device="cpu")
    assert describe(past).peak == describe(live).peak and describe(past).speed == describe(live).speed
    assert (past.step, past.total_steps, describe(past).state) == (3, 10, "finished")
    assert describe(past).time == "", "a past run's folder does not say how long it took"


def test_a_stopped_run_reads_stopped_wherever_it_is_shown() -> None:
    assert state_of_record("interrupted", STOPPED_MESSAGE) == "stopped"
    assert state_of_record("interrupted", None) == "interrupted"
    assert state_of_record("finished", None) == "finished"


def test_earlier_runs_become_measured_rows(tmp_path: Path) -> None:
    from engine.run.registry import Registry

    folder = tmp_path / "run"
    folder.mkdir()
    with (folder / "metrics.jsonl").open("w", encoding="utf-8") as handle:
        for n in (1, 2):
            record = step(n, tokens=900, seconds=0.5).to_dict()
            record.pop("kind")
            handle.write(json.dumps(record) + "\n")
    registry = Registry(tmp_path / "runs.sqlite3")
    config = {"model": {"name": "demo", "qlora": False}, "data": {"tokens_per_batch": 1024},
              "training": {"grad_accum": 2}}  # fmt: skip
    registry.upsert(folder, status="finished", config=config, hardware={"device": "cpu"})
    registry.upsert(tmp_path / "failed", status="failed", config=config, hardware={"device": "cpu"})
    (row,) = measured_rows(registry.runs())
    assert (row.gpu_class, row.model, row.tokens_per_batch) == ("cpu", "demo", 2048)
    assert row.tokens_per_s == pytest.approx(2048 / 0.5), "the configured tokens per step over the mean step time"


@pytest.mark.parametrize(
    ("hardware", "expected"),
    [
        ({"device": "cpu", "gpus": []}, ("cpu", "")),
        ({"device": "cuda:0", "gpus": ["NVIDIA H200"], "gpu_class": "hopper"}, ("hopper", "NVIDIA H200")),
        ({"device": "cuda:0", "gpus": ["NVIDIA GeForce RTX 4090"]}, ("rtx-consumer", "NVIDIA GeForce RTX 4090")),
    ],
)
def test_the_gpu_class_of_a_recorded_run(hardware: dict[str, object], expected: tuple[str, str]) -> None:
    assert gpu_class_of(hardware) == expected


def test_the_command_line_lists_runs_in_the_same_words(tmp_path: Path) -> None:
    import io

    from engine.cli.runs import print_record, print_table
    from engine.run.registry import Registry

    folder = tmp_path / "run"
    folder.mkdir()
    with (folder / "metrics.jsonl").open("w", encoding="utf-8") as handle:
        for n in (1, 2, 3):
            record = step(n, memory=1.5).to_dict()
            record.pop("kind")
            handle.write(json.dumps(record) + "\n")
    registry = Registry(tmp_path / "runs.sqlite3")
    registry.upsert(folder, status="interrupted", message=STOPPED_MESSAGE, hardware={"device": "cpu"},
                    tokens_per_s=1.0)  # fmt: skip
    (record,) = registry.runs()
    texts = describe(summary_of_folder(folder, "stopped", device="cpu"))
    table, shown = io.StringIO(), io.StringIO()
    print_table([record], table)
    print_record(record, shown)
    assert texts.speed == "2,000 tokens/s" and texts.peak == "1.50 GiB (process memory)"
    assert texts.speed in table.getvalue() and texts.peak in table.getvalue(), table.getvalue()
    assert table.getvalue().rstrip().endswith("stopped"), "the registry's 'interrupted' is a stop the user asked for"
    assert "tokens/s:    2,000 (mean over its steps)" in shown.getvalue()
    assert "peak memory: measured 1.50 GiB (process memory)" in shown.getvalue()
