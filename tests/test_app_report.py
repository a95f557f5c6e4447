"""The before/after report in the window: a run started in the app ends with its report written and offered on the
Run page, the Report page shows base and tuned side by side, and the Runs page's Report button measures a run that
has none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from app_demo import LOAD_TIMEOUT_MS, prepare_demo
from hang import HANG_MS
from helpers import write_jsonl

from app.background import run_controller as rc
from engine.config import RunConfig
from engine.events import RunFinished
from engine.run.recorder import recorded
from engine.run.registry import Registry
from engine.train import run

pytest_plugins = ["app_fixtures"]

RUN_TIMEOUT_MS = HANG_MS
REPORT_TIMEOUT_MS = HANG_MS
SCREENSHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"


def assert_shows_base_and_tuned(page: Any, run_dir: Path) -> None:
    """The Report page shows ``run_dir``'s report as written: a figure per bar group, base and tuned each."""
    written = json.loads((run_dir / "report.json").read_text())
    assert page.folder == str(run_dir) and page.report is not None
    labels = [m["label"] for m in written["models"]]
    assert labels[0] == "base model" and len(labels) >= 2 and page.chart.labels == labels
    texts = page.chart.bar_texts()
    names = [figure.name for figure in page.chart.figures]
    if any(m.get("knowledge_kept_share") is not None for m in written["models"]):
        assert names.pop(0).startswith("knowledge kept")  # the headline first
    assert names[0].startswith("held-out loss")
    assert names[-1].startswith("general English perplexity")
    assert all(len(row) == len(labels) and "-" not in row for row in texts), texts
    general = [f"{m['general_perplexity']:,.1f}" for m in written["models"]]
    assert texts[-1] == general  # the chart says what report.json says
    assert "general English perplexity" in page.forgetting.text() and "forgotten" in page.forgetting.text()
    assert f"Before and after: {run_dir.name}" in page.text.toPlainText()


def test_a_run_in_the_window_ends_with_its_report_on_the_report_page(qtbot: Any, window: Any) -> None:
    report_page, panel = window.page("Report"), window.run_panel
    assert "No report shown yet" in report_page.status.text() and not report_page.figures.isVisible()
    prepare_demo(qtbot, window, max_steps=4)
    ends: list[RunFinished] = []
    said: list[str] = []
    window.controller.run_event.connect(lambda e: ends.append(e) if isinstance(e, RunFinished) else None)
    report_page.building.connect(lambda folder: said.append(panel.report_status.text()))
    assert not panel.open_report_button.isVisible()
    panel.start_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.FINISHED, timeout=LOAD_TIMEOUT_MS + RUN_TIMEOUT_MS)
    run_dir = Path(ends[-1].run_dir)
    qtbot.waitUntil(lambda: panel.open_report_button.isVisible(), timeout=REPORT_TIMEOUT_MS)
    assert (run_dir / "report.json").exists() and (run_dir / "report.md").exists()
    assert said and "Building the before/after report" in said[0], said  # what the Run page said meanwhile
    assert str(run_dir / "report.md") in panel.report_status.text()
    panel.open_report_button.click()
    assert window.current_page() == "Report"
    qtbot.waitUntil(lambda: report_page.report is not None and not report_page.busy(), timeout=REPORT_TIMEOUT_MS)
    assert_shows_base_and_tuned(report_page, run_dir)
    written = json.loads((run_dir / "report.json").read_text())
    assert written["answers_scored"] > 0  # the demo's answers are short dates: exact match and F1 for both
    assert all(m["exact_match"] is not None and m["token_f1"] is not None for m in written["models"])
    assert any(name.startswith("short answers: exact match") for name in (f.name for f in report_page.chart.figures))
    window.resize(1280, 900)  # the window's first size on a desktop screen, not the offscreen screen's share
    qtbot.waitUntil(lambda: report_page.width() > 1000)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    assert window.grab().save(str(SCREENSHOTS / "report_page.png"))


def earlier_run(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A short run made outside the window, so without a report."""
    rows = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"number {i}"}]}
            for i in range(16)]  # fmt: skip
    config = RunConfig.from_dict(
        {
            "model": {"name": str(tiny_model_dir)},
            "data": {"path": str(write_jsonl(tmp_path / "chat.jsonl", rows)), "max_seq_len": 64,
                     "tokens_per_batch": 128, "eval_fraction": 0.25},
            "training": {"max_steps": 2, "learning_rate": 5e-3, "warmup_steps": 0, "save_every": 0, "eval_every": 0},
            "output": {"dir": str(tmp_path / "runs"), "name": "earlier"},
        }
    )  # fmt: skip
    events = list(recorded(run(config), Registry(), name="earlier"))
    run_dir = Path(next(e for e in events if isinstance(e, RunFinished)).run_dir)
    assert not (run_dir / "report.json").exists()
    return run_dir


def test_the_runs_page_report_button_measures_a_run_without_a_report(
    qtbot: Any, window: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    run_dir = earlier_run(tiny_model_dir, tmp_path)
    runs, report_page = window.page("Runs"), window.page("Report")
    window.show_page("Runs")
    runs.refresh()
    runs.select_runs([r.id for r in runs.records if Path(r.folder) == run_dir])
    assert runs.report_button.isEnabled()
    runs.report_button.click()
    assert window.current_page() == "Report" and "Building the before/after report" in report_page.status.text()
    qtbot.waitUntil(lambda: report_page.report is not None and not report_page.busy(), timeout=REPORT_TIMEOUT_MS)
    assert (run_dir / "report.json").exists()
    assert_shows_base_and_tuned(report_page, run_dir)
    runs.select_runs([])
    assert not runs.report_button.isEnabled()


def test_closing_the_window_stops_a_report_being_measured(
    qtbot: Any, window: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    run_dir = earlier_run(tiny_model_dir, tmp_path)
    report_page = window.page("Report")
    notes: list[str] = []
    report_page.failed.connect(lambda folder, note: notes.append(note))
    report_page.build(str(run_dir))
    assert report_page.busy()
    window.close()  # the measurement is still loading the model: it stops at its next batch
    qtbot.waitUntil(lambda: not window.tasks.busy(), timeout=REPORT_TIMEOUT_MS)
    qtbot.waitUntil(lambda: bool(notes), timeout=REPORT_TIMEOUT_MS)
    assert "stopped before its end" in notes[0] and f"tunedeck report {run_dir}" in notes[0]
    assert not (run_dir / "report.json").exists() and not (run_dir / "report.md").exists()


def test_a_report_that_ends_after_the_page_was_deleted_is_only_marked_ended(qtbot: Any) -> None:
    """A job's result can arrive after the window closed and deleted the page's widgets: the page marks the job ended
    (closing waits on that) and touches nothing else."""
    import shiboken6

    from app.background.worker import TaskRunner
    from app.pages.report import ReportPage
    from engine.run.report import ReportOutcome

    page = ReportPage(TaskRunner())
    page._jobs.add("/runs/a")
    shiboken6.delete(page)
    page._done("/runs/a", ReportOutcome(None, None, "stopped; try: tunedeck report /runs/a"))
    assert not page.busy()


def test_a_dpo_report_is_drawn_against_chance(qtbot: Any) -> None:
    import pyqtgraph as pg

    from app.widgets.report_chart import ReportChart
    from engine.run.report import ModelScores, RunReport

    before = ModelScores("starting adapter", None, 5.0, None, 20.0, preferred=0.5)
    best = ModelScores("best adapter (step 4)", 0.6, 4.0, 0.75, 21.0, preferred=0.875)
    chart = ReportChart()
    qtbot.addWidget(chart)
    chart.show_report(RunReport("run", "dpo", 8, 100, 3000, [before, best]))
    names = [figure.name for figure in chart.figures]
    assert names[0] == "held-out pairs preferred (higher is better; chance is 50%)"
    assert chart.bar_texts()[:3] == [["50%", "88%"], ["-", "0.600"], ["-", "75%"]]  # no reward before the run
    (line,) = [item for item in chart._drawn if isinstance(item, pg.PlotDataItem)]
    x, _ = line.getData()
    assert list(x) == pytest.approx([0.5 / 0.875] * 2)  # chance, on the scale of the group's largest bar
