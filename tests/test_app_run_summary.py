"""Every page says the same about a run: a demo run driven through the window, compared page by page while it is
paused half-way and after it finished; and the plan's time estimate before Start, live, and against the time taken."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app_demo import LOAD_TIMEOUT_MS, prepare_demo
from hang import HANG_MS

from app.background import run_controller as rc
from engine.events import StepMetrics
from engine.run.registry import Registry
from engine.run.summary import RunTexts, describe, summary_of_record

pytest_plugins = ["app_fixtures"]

STEP_TIMEOUT_MS = HANG_MS
STEPS = 12


def runs_row(window: Any, run_dir: str) -> dict[str, str]:
    """The Runs page's row of the run, column title -> text, after the page read the history again."""
    from app.pages.runs import COLUMNS

    runs = window.page("Runs")
    runs.refresh()
    row = next(i for i, record in enumerate(runs.records) if Path(record.folder) == Path(run_dir).resolve())
    return {title: runs.table.item(row, column).text() for column, title in enumerate(COLUMNS)}


def assert_pages_agree(window: Any, texts: RunTexts, run_dir: str) -> None:
    assert texts.peak and texts.speed and texts.state
    assert window.run_panel.summary.text() == texts.line(), "the Run page shows the summary"
    row = runs_row(window, run_dir)
    assert (row["Status"], row["Speed (mean)"], row["Peak memory (measured)"]) == (
        texts.state, texts.speed, texts.peak,
    ), "the Runs page shows the same state, speed and peak"  # fmt: skip


def test_every_page_shows_the_same_state_peak_and_speed_during_and_after_a_run(qtbot: Any, window: Any) -> None:
    prepare_demo(qtbot, window, max_steps=STEPS)
    plan = window.run_panel.plan.text()
    assert plan.startswith("Plan for the next run: predicted peak memory ") and " GiB" in plan, plan
    assert "training takes about " in plan and "(from the planner's figure for this computer's CPU)" in plan, plan
    steps: list[StepMetrics] = []
    window.controller.run_event.connect(lambda e: steps.append(e) if isinstance(e, StepMetrics) else None)
    window.run_panel.start_button.click()
    qtbot.waitUntil(lambda: len(steps) >= 4, timeout=STEP_TIMEOUT_MS)
    window.controller.pause()
    qtbot.waitUntil(lambda: window.state.run.state == "paused", timeout=STEP_TIMEOUT_MS)
    run = window.state.run
    texts = describe(run)
    assert texts.state == "paused" and texts.progress == f"step {len(steps)} of {STEPS}"
    assert texts.peak.endswith("(process memory)") and texts.planned, "measured and predicted, each labelled"
    assert " left (from its first " in texts.time, texts.time
    assert_pages_agree(window, texts, run.run_dir)
    guide = window.guide.next.toolTip()
    assert guide.startswith(f"Paused · step {len(steps)} of {STEPS} · {texts.speed} · peak memory measured: "
                            f"{texts.peak}"), guide  # fmt: skip
    logged = summary_of_record(Registry().find_folder(run.run_dir))
    assert (describe(logged).peak, describe(logged).speed) == (texts.peak, texts.speed), "the run's log agrees"

    window.controller.resume()
    qtbot.waitUntil(lambda: window.controller.state == rc.FINISHED, timeout=STEP_TIMEOUT_MS)
    qtbot.waitUntil(lambda: not window.controller.worker.isRunning(), timeout=LOAD_TIMEOUT_MS)
    run = window.state.run
    texts = describe(run)
    assert texts.state == "finished" and run.step == STEPS
    assert texts.time.startswith("estimated ") and ", training took " in texts.time, texts.time
    assert_pages_agree(window, texts, run.run_dir)  # the Runs page now reads the run's folder
    recorded = Registry().find_folder(run.run_dir)
    assert f"{recorded.tokens_per_s:,.0f} tokens/s" == texts.speed, "the run history keeps the same mean speed"
    chat = window.page("Chat")
    assert Path(chat.runs.currentData()) == Path(run.run_dir).resolve(), "Chat picks the run that just finished"
    line = chat.run_info.text()
    assert line.startswith("Finished · ") and f"peak memory measured: {texts.peak}" in line and texts.speed in line

    # the next run's plan goes by this one: its speed measured here
    estimate = window.setup_panel.estimates["Demo"]
    qtbot.waitUntil(lambda: "(from 1 earlier run of this model here)" in estimate.text(), timeout=LOAD_TIMEOUT_MS)
    assert " · 60 steps · about " in estimate.text(), estimate.text()
    plan = window.run_panel.plan.text()
    assert plan.startswith("Plan for the next run: ") and "training takes about " in plan, plan
    assert plan.endswith("(from 1 earlier run of this model here)"), plan
