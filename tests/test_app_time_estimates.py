"""Time estimates on the Recipe and Run pages: there is one before the first run (the planner's step time on this
CPU), and after a run it follows that run's steps, scaled to each recipe's steps, with time beside the steps (a
pause, a later rename) left out."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from hang import HANG_MS
from test_app_day_of_use import run_demo

from engine.hardware.recipes import DEMO_RECIPE, RECIPES

pytest_plugins = ["app_fixtures"]

SECONDS = re.compile(r"about (?:(\d+) min )?(\d+) s|about (\d+) min\b")


def seconds_in(text: str) -> float:
    """The time in a recipe's line ('… · about 1 min 05 s (from …)')."""
    found = SECONDS.search(text)
    assert found is not None, f"no time in {text!r}"
    minutes, secs, whole_minutes = found.groups()
    return 60 * int(whole_minutes) if whole_minutes else 60 * int(minutes or 0) + int(secs)


def visible_recipe_lines(window: Any) -> dict[str, str]:
    panel = window.setup_panel
    return {name: label.text() for name, label in panel.estimates.items() if not label.isHidden()}


def test_every_recipe_says_its_time_before_the_first_run_on_a_cpu(qtbot: Any, window: Any) -> None:
    from app_demo import prepare_demo

    prepare_demo(qtbot, window, max_steps=60)
    lines = visible_recipe_lines(window)
    assert {recipe.name for recipe in RECIPES} <= lines.keys()
    for name, text in lines.items():
        assert "known after" not in text, f"{name}: {text}"
        assert seconds_in(text) > 0 and "the planner's figure for this computer's CPU" in text, f"{name}: {text}"
    planned = window.state.planned_time
    assert planned is not None and planned.seconds, "the Run page has the chosen settings' time before Start"
    window.run_panel.show_summary()
    assert "training takes about" in window.run_panel.plan.text()


def test_an_earlier_runs_steps_set_the_estimate_scaled_by_steps_without_its_pauses(
    qtbot: Any, window: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.run.registry import Registry

    folder = run_demo(qtbot, window, steps=4)
    registry = Registry()
    (record,) = [record for record in registry.runs() if record.folder == folder]
    later = time.time() + 600  # renamed ten minutes on: the record's clock moves, the run's steps do not
    with monkeypatch.context() as patch:  # the window's own patches (its data folder) stay
        patch.setattr("engine.run.registry.time.time", lambda: later)
        registry.rename(record.id, "renamed-later")
    window.state.measured = []
    window.load_measured_runs()
    qtbot.waitUntil(lambda: window.state.measured != [], timeout=HANG_MS)  # read again, after the rename

    steps = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    step_s = sum(step["step_time_s"] for step in steps) / len(steps)
    demo_line = window.setup_panel.estimates[DEMO_RECIPE].text()
    assert "60 steps" in demo_line and "from 1 earlier run of this model here" in demo_line, demo_line
    assert seconds_in(demo_line) == pytest.approx(60 * step_s, abs=1.0), demo_line
