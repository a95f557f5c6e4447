"""A run that learns from rewards (GRPO), watched in the window: the Run page charts mean reward (total, each
reward, held-out), answer length and KL as the run's steps arrive, lists the answers it sampled with each reward's
score and the total, and the report that follows gives the held-out mean reward and the knowledge check. Other
methods' runs keep the page's own charts alone, and every run starts the view empty."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from app_demo import LOAD_TIMEOUT_MS
from hang import HANG_MS
from helpers import write_jsonl

from app.background import run_controller as rc
from engine.config import RunConfig
from engine.events import AnswersSampled, EvalMetrics, RunStarted, StepMetrics
from engine.run.loop import _metrics_record

pytest_plugins = ["app_fixtures"]

SCREENSHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"
REWARDS = [
    {"kind": "regex", "settings": {"pattern": r"\d"}},
    {"kind": "length", "weight": 0.5, "settings": {"min": 1, "max": 6}},
]


def grpo_config(model: Path, tmp_path: Path, method: str = "grpo", **training: object) -> RunConfig:
    rows = [{"prompt": f"say a number, {i}:", "answer": str(i)} for i in range(6)]
    method_settings: dict[str, object] = {"group_size": 4, "max_new_tokens": 6, "kl_beta": 0.05, "rewards": REWARDS}
    return RunConfig.from_dict(
        {
            "model": {"name": str(model), "dtype": "float32"},
            "data": {"path": str(write_jsonl(tmp_path / "prompts.jsonl", rows)), "eval_fraction": 0.34,
                     "max_seq_len": 64, "tokens_per_batch": 256},
            "lora": {"rank": 4},
            "training": {"method": method, "max_steps": 3, "grad_accum": 2, "save_every": 0, "eval_every": 0,
                         "device": "cpu", "keep_knowledge": False, "learning_rate": 1e-2,
                         **(method_settings if method == "grpo" else {}), **training},
            "output": {"dir": str(tmp_path / "runs"), "name": f"{method}-run"},
        }
    )  # fmt: skip


def scroll_area(widget: Any) -> Any:
    from app.widgets.page_chart import scrolling_ancestor

    return scrolling_ancestor(widget)


def curve(item: Any) -> tuple[list[float], list[float]]:
    x, y = item.getData()
    return ([] if x is None else [float(v) for v in x]), ([] if y is None else [float(v) for v in y])


def assert_charts_show(charts: Any, events: list[object]) -> None:
    """The reward charts draw what the run's events said, step by step."""
    steps = [e for e in events if isinstance(e, StepMetrics)]
    charts.redraw_all()
    numbers = [float(e.step) for e in steps]
    assert curve(charts.total_curve) == (numbers, [e.reward_mean for e in steps])
    assert list(charts.reward_curves) == ["regex", "length"], "one curve per reward, in the recipe's order"
    for name, item in charts.reward_curves.items():
        assert curve(item) == (numbers, [e.reward_means[name] for e in steps])  # type: ignore[index]
    assert curve(charts.length_curve) == (numbers, [e.completion_length for e in steps])
    assert curve(charts.kl_curve) == (numbers, [e.kl for e in steps])
    held_out = [e for e in events if isinstance(e, EvalMetrics)]
    assert held_out and curve(charts.held_out_dots) == (
        [float(e.step) for e in held_out],
        [e.reward_mean for e in held_out],
    )


def assert_answers_show(answers: Any, shown: AnswersSampled) -> None:
    """The latest sampled answers with each reward's score (before its weight) and their weighted total."""
    assert answers.step == shown.step and shown.prompt in answers.prompt.toolTip()
    assert answers.headings() == ["Answer", "regex", "length ×0.5", "Total"]
    assert shown.scores is not None and list(shown.scores) == ["regex", "length"]
    for row, cells in enumerate(answers.cells()):
        regex, length = shown.scores["regex"][row], shown.scores["length"][row]
        assert shown.rewards[row] == pytest.approx(regex + 0.5 * length), "the total is the weighted sum"
        assert cells[1:] == [f"{regex:.2f}", f"{length:.2f}", f"{shown.rewards[row]:.2f}"]
        assert answers.table.item(row, 0).toolTip() == shown.answers[row]
    assert len(answers.cells()) == len(shown.answers) > 0


def test_a_grpo_run_in_the_window_charts_its_rewards_and_shows_its_answers(
    qtbot: Any, window: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    panel = window.run_panel
    assert panel.rewards.isHidden(), "no reward view before a run that learns from rewards"
    events: list[object] = []
    window.controller.run_event.connect(events.append)
    shown_during: list[int] = []
    window.controller.run_event.connect(
        lambda e: shown_during.append(panel.rewards.answers.step) if isinstance(e, StepMetrics) else None
    )
    panel.start_config(grpo_config(tiny_model_dir, tmp_path))
    assert window.current_page() == "Run" and panel.rewards.isVisible()
    qtbot.waitUntil(lambda: window.controller.state == rc.FINISHED, timeout=LOAD_TIMEOUT_MS + HANG_MS)
    sampled = [e for e in events if isinstance(e, AnswersSampled)]
    sampled_steps = [e for e in events if isinstance(e, StepMetrics)]
    assert [e.step for e in sampled] == [1, 2, 3]
    assert shown_during[1:] == [1, 2], "each step's answers were on the page when the next step arrived"
    assert_charts_show(panel.rewards.charts, events)
    assert_answers_show(panel.rewards.answers, sampled[-1])
    panel.charts.redraw_all()  # charts redraw on a timer: the last step may still wait for its tick
    assert curve(panel.charts.train_curve)[0] == [1.0, 2.0, 3.0], "the loss chart goes on beside them"

    assert panel.progress.text().endswith(f"reward {sampled_steps[-1].reward_mean:.3f}")
    window.resize(1366, 768)  # a laptop's screen: the page scrolls to the reward view, which keeps its height
    qtbot.waitUntil(lambda: panel.rewards.charts.reward.height() >= 200)
    scroll_area(panel).verticalScrollBar().setValue(panel.rewards.y())  # the page scrolled to the reward view
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    assert window.grab().save(str(SCREENSHOTS / "run_page_grpo.png"))
    panel.rewards.grab().save(str(SCREENSHOTS / "run_page_grpo_rewards.png"))

    qtbot.waitUntil(lambda: panel.open_report_button.isVisible(), timeout=HANG_MS)
    panel.open_report_button.click()
    page = window.page("Report")
    qtbot.waitUntil(lambda: page.report is not None and not page.busy(), timeout=HANG_MS)
    written = json.loads((Path(panel.ended_run) / "report.json").read_text())
    names = [figure.name for figure in page.chart.figures]
    assert "held-out mean reward (higher is better)" in names
    row = page.chart.bar_texts()[names.index("held-out mean reward (higher is better)")]
    assert row == [format(m["mean_reward"], ".2f") for m in written["models"]], "base and tuned, as report.json"
    assert written["knowledge_questions"] > 0 and "knowledge: kept" in page.forgetting.text()
    assert "held-out mean reward" in page.text.toPlainText()


def step(number: int, reward: float, kl: float | None) -> StepMetrics:
    """A reward run's step as the engine reports it (the figures the reward view reads, the rest plausible)."""
    figures = {"reward_means": {"regex": reward, "length": 1.0}, "completion_length": 4.0 + number, "kl": kl}
    return StepMetrics(number, 3, 0.1, 0.5, 1e-3, 1.0, 100, 100, 0.1, 1000.0, 1 << 20, reward_mean=reward, **figures)


def test_only_reward_runs_show_the_view_and_each_run_starts_it_empty(
    qtbot: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from app.widgets.reward_progress import RewardProgress

    sft, grpo = grpo_config(tiny_model_dir, tmp_path, "sft"), grpo_config(tiny_model_dir, tmp_path)
    view = RewardProgress()
    qtbot.addWidget(view)
    view.begin(sft)
    assert view.isHidden()
    view.begin(grpo)
    assert not view.isHidden()
    for event in (step(1, 0.25, 0.01), AnswersSampled(1, "p", ["a 1", ""], [1.5, 0.0], {"regex": [1.0, 0.0],
                  "length": [1.0, 0.0]}), EvalMetrics(1, -0.5, 10, reward_mean=0.5)):  # fmt: skip
        view.on_event(event)
    view.charts.redraw_all()
    assert curve(view.charts.total_curve) == ([1.0], [0.25]) and view.answers.cells()[1][0] == "(empty answer)"
    view.begin(
        dataclasses.replace(grpo, training=dataclasses.replace(grpo.training, kl_beta=0.0))
    )  # the next run: nothing of the last one, and no KL to draw
    view.charts.redraw_all()
    assert curve(view.charts.total_curve) == ([], []) and curve(view.charts.held_out_dots) == ([], [])
    assert view.charts.reward_curves == {} and view.answers.cells() == [] and view.answers.step == 0
    assert "no KL penalty" in view.charts.kl.getPlotItem().titleLabel.text
    view.on_event(step(1, 0.5, None))
    view.charts.redraw_all()
    assert curve(view.charts.kl_curve) == ([], []) and curve(view.charts.length_curve) == ([1.0], [5.0])


def test_a_resumed_run_draws_the_steps_already_logged(qtbot: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    from app.widgets.reward_progress import RewardProgress

    folder = tmp_path / "resumed"
    folder.mkdir()
    logged = [step(n, 0.1 * n, 0.01 * n) for n in (1, 2, 3)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(_metrics_record(e)) + "\n" for e in logged))
    (folder / "eval.jsonl").write_text(json.dumps({"step": 2, "eval_loss": -0.4, "tokens": 9, "reward_mean": 0.4}))
    view = RewardProgress()
    qtbot.addWidget(view)
    view.begin(grpo_config(tiny_model_dir, tmp_path))
    view.on_event(RunStarted(str(folder), "cpu", "float32", 5, 2, 4, 2, 4, 1.0, 10, 100))
    view.on_event(step(3, 0.9, 0.05))  # the resumed run's own next step
    view.charts.redraw_all()
    assert curve(view.charts.total_curve) == ([1.0, 2.0, 3.0], pytest.approx([0.1, 0.2, 0.9]))
    assert curve(view.charts.held_out_dots) == ([2.0], [0.4])
