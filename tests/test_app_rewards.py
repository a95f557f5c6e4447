"""The reward builder on the Recipe page: rewards added with their settings and weights become the run's reward
specs, a bad one says why under itself, and "Try" scores a tiny model's answers in the background."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hang import HANG_MS
from helpers import write_jsonl

from app.app_state import AppState
from app.background.worker import TaskRunner
from app.pages.recipe import REWARD_METHOD, SetupPanel
from app.widgets.reward_panel import TRIAL_PROMPTS, RewardPanel
from app.widgets.reward_row import reward_flag
from engine.rewards import RewardError, RewardSpec, build_rewards, score_completions

pytest_plugins = ["app_fixtures"]


@pytest.fixture
def panel(qtbot: Any) -> Any:
    tasks = TaskRunner()
    widget = RewardPanel(AppState(), tasks)
    qtbot.addWidget(widget)
    yield widget
    tasks.wait_all(HANG_MS)


def problem(row: Any) -> str:
    return "" if row.error.isHidden() else str(row.error.text())


@pytest.mark.parametrize(
    ("kind", "text", "option", "flag"),
    [
        ("regex", r"^\d+$", 0, r"regex:^\d+$"),
        ("regex", r"\d+ ", 1, "regex-full:\\d+ "),
        ("reference", "", 1, "reference:contains"),
        ("reference", " gold ", 0, "reference:equals:column=gold"),
        ("json", "name,age", 0, "json:keys=name,age"),
        ("json", "", 1, "json:fenced=no"),
        ("length", "20-200", 1, "length:20-200:words"),
        ("python", "/x/r.py", 0, "python:/x/r.py"),
    ],
)
def test_a_rows_fields_are_the_command_lines_words(kind: str, text: str, option: int, flag: str) -> None:
    assert reward_flag(kind, text, option) == flag


def test_added_rewards_become_weighted_specs(panel: Any) -> None:
    regex = panel.add_reward("regex")
    regex.text.setText(r"^\d+$")
    regex.weight.setValue(0.5)
    panel.add_reward("reference").option.setCurrentIndex(1)
    length = panel.add_reward("length")
    length.text.setText("5-40")
    length.option.setCurrentIndex(1)
    assert panel.specs() == (
        RewardSpec("regex", 0.5, (("pattern", r"^\d+$"),)),
        RewardSpec("reference", 1.0, (("mode", "contains"),)),
        RewardSpec("length", 1.0, (("min", 5), ("max", 40), ("unit", "words"))),
    )
    assert panel.try_button.isEnabled()
    panel.remove_reward(regex)
    assert [spec.kind for spec in panel.specs()] == ["reference", "length"]


def test_an_invalid_regex_shows_its_error(qtbot: Any, panel: Any) -> None:
    row = panel.add_reward("regex")
    assert "needs" in problem(row) and not panel.try_button.isEnabled()
    row.text.setText("(unclosed")
    qtbot.waitUntil(lambda: "not a valid regular expression" in problem(row), timeout=HANG_MS)
    assert "1 of 1 rewards cannot be built" in panel.status.text()
    with pytest.raises(RewardError, match=r"Matches a regular expression: .*not a valid regular expression"):
        panel.specs()
    row.text.setText("(closed)")
    qtbot.waitUntil(lambda: problem(row) == "" and panel.try_button.isEnabled(), timeout=HANG_MS)


def test_no_reward_is_an_error(panel: Any) -> None:
    with pytest.raises(RewardError, match="no reward chosen"):
        panel.specs()
    assert not panel.try_button.isEnabled()


def test_a_python_file_from_the_file_dialog(
    qtbot: Any, panel: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PySide6.QtWidgets import QFileDialog

    path = tmp_path / "mine.py"
    path.write_text("def score(prompt, completion):\n    return 1\n")
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *args, **kwargs: (str(path), "Python files (*.py)"))
    row = panel.add_reward("python")
    row.choose_file()
    qtbot.waitUntil(lambda: "defines no reward function" in problem(row), timeout=HANG_MS)
    path.write_text("def reward(prompt, completion, **row):\n    return len(completion) > 3\n")
    panel.check()  # the file changed: read again
    assert problem(row) == ""
    assert panel.specs() == (RewardSpec("python", 1.0, (("path", str(path)),)),)


def test_the_builder_shows_for_reward_tuning_only(qtbot: Any) -> None:
    page = SetupPanel(AppState())
    qtbot.addWidget(page)
    method = page.form.editor("training.method")
    assert page.rewards.isHidden()
    if method.findText(REWARD_METHOD) < 0:  # a build whose config does not list the method yet
        method.addItem(REWARD_METHOD)
    method.setCurrentText(REWARD_METHOD)
    assert not page.rewards.isHidden()
    method.setCurrentText("sft")
    assert page.rewards.isHidden()


def test_try_scores_a_tiny_models_answers(qtbot: Any, panel: Any, tmp_path: Path, tiny_model_dir: Path) -> None:
    rows = [{"prompt": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(6)]
    panel.state.model_name = str(tiny_model_dir)
    panel.state.data_path = str(write_jsonl(tmp_path / "prompts.jsonl", rows))
    panel.add_reward("reference").option.setCurrentIndex(1)
    length = panel.add_reward("length")
    length.text.setText("10-60")
    length.weight.setValue(0.5)
    with qtbot.waitSignal(panel.tried, timeout=HANG_MS):
        panel.try_button.click()
        assert not panel.try_button.isEnabled()  # one trial at a time
    table = panel.results
    assert not table.isHidden() and table.rowCount() == TRIAL_PROMPTS, panel.trial_status.text()
    headers = [table.horizontalHeaderItem(c).text() for c in range(table.columnCount())]
    assert headers == ["Row", "Prompt", "Answer", "reference", "length ×0.5", "Total"]
    answers = [table.item(r, 2).toolTip() for r in range(TRIAL_PROMPTS)]  # the cell shows it on one line
    expected = score_completions(
        build_rewards(panel.specs()),
        [row["prompt"] for row in rows[:TRIAL_PROMPTS]],
        answers,
        rows[:TRIAL_PROMPTS],
        list(range(1, TRIAL_PROMPTS + 1)),
    )
    shown = [float(table.item(r, c).text()) for r in range(TRIAL_PROMPTS) for c in (3, 4, 5)]
    wanted = [x for r in range(TRIAL_PROMPTS) for x in (*(per[r] for per in expected.per_reward), expected.total[r])]
    assert shown == pytest.approx(wanted, abs=0.005)
    assert panel.try_button.isEnabled() and panel.trial_status.text().startswith("Scores of the base model's answers")


def test_try_without_a_dataset_says_so(panel: Any) -> None:
    panel.add_reward("json")
    panel.try_button.click()
    assert "no dataset chosen" in panel.trial_status.text()


def test_start_waits_for_buildable_rewards(qtbot: Any, tmp_path: Path) -> None:
    page = reward_tuning_page(qtbot, tmp_path)
    assert page.step_status()[0]
    page.form.editor("training.method").setCurrentText(REWARD_METHOD)
    assert "no reward chosen" in page.step_status()[1]
    row = page.rewards.add_reward("regex")
    row.text.setText("[")
    qtbot.waitUntil(lambda: "not a valid regular expression" in page.step_status()[1], timeout=HANG_MS)
    row.text.setText("[a-z]+")
    qtbot.waitUntil(lambda: page.step_status()[0], timeout=HANG_MS)
    page.form.editor("training.method").setCurrentText("sft")
    page.rewards.add_reward("regex")  # an unbuilt reward of a method that takes none stops nothing
    qtbot.waitUntil(lambda: page.step_status()[0], timeout=HANG_MS)


def reward_tuning_page(qtbot: Any, tmp_path: Path) -> Any:
    """The Recipe page with a dataset of prompts, where the config takes rewards (skipped where it does not yet)."""
    from engine.config import TrainingConfig

    if "rewards" not in {field.name for field in dataclasses.fields(TrainingConfig)}:
        pytest.skip("this build's config has no rewards to fill")
    state = AppState()
    state.data_path = str(write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "2+2?", "answer": "4"}]))
    page = SetupPanel(state)
    qtbot.addWidget(page)
    return page


def test_the_run_config_gets_the_chosen_rewards(qtbot: Any, tmp_path: Path) -> None:
    page = reward_tuning_page(qtbot, tmp_path)
    page.form.editor("training.method").setCurrentText(REWARD_METHOD)
    qtbot.waitUntil(lambda: "no reward chosen" in page.warning.text(), timeout=HANG_MS)
    assert not page.step_status()[0]
    page.rewards.add_reward("reference").option.setCurrentIndex(1)
    page.rewards.add_reward("regex").text.setText(r"\d")
    qtbot.waitUntil(lambda: page.warning.text() == "" and page.step_status()[0], timeout=HANG_MS)
    config = page.build_config()
    assert config.training.method == REWARD_METHOD
    assert (
        config.training.rewards
        == page.rewards.specs()
        == (
            RewardSpec("reference", settings=(("mode", "contains"),)),
            RewardSpec("regex", settings=(("pattern", r"\d"),)),
        )
    )
