"""Screenshots of every page during a demo run, and the speed page's A/B Compare on that run.

The pictures land in ``artifacts/screenshots/`` (git-ignored) so anyone can look at what a user sees:
``.venv/bin/python -m pytest tests/test_app_screenshots.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from app_demo import LOAD_TIMEOUT_MS, prepare_demo

from app import run_controller as rc
from engine.events import StepMetrics

pytest_plugins = ["app_fixtures"]

SCREENSHOTS = Path(__file__).resolve().parent.parent / "artifacts" / "screenshots"
STEP_TIMEOUT_MS = 120_000
MAIN_PAGES = ("This computer", "Model", "Dataset", "Recipe", "Run", "Speed")


def save_page(window: Any, title: str) -> Path:
    window.show_page(title)
    window.run_panel.charts.redraw_all()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{title.lower().replace(' ', '-')}.png"
    assert window.grab().save(str(path)), f"could not write {path}"
    return path


def test_screenshots_and_compare_during_a_demo_run(qtbot: Any, window: Any) -> None:
    window.resize(1280, 820)
    prepare_demo(qtbot, window, max_steps=80)
    steps: list[int] = []
    window.controller.run_event.connect(lambda e: steps.append(e.step) if isinstance(e, StepMetrics) else None)
    saved = [save_page(window, title) for title in ("This computer", "Model", "Dataset", "Recipe")]
    speed = window.speed_panel
    assert not speed.metadata_box.isEnabled(), "switches act on a live run only"
    assert speed.reasons["metadata_cache"].text().startswith("Planned: ")
    assert speed.reasons["moe_routing"].text() == "No — this model has no MoE expert layers"
    window.run_panel.start_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.RUNNING, timeout=LOAD_TIMEOUT_MS)
    qtbot.waitUntil(lambda: len(steps) >= 4, timeout=STEP_TIMEOUT_MS)

    assert speed.metadata_box.isEnabled()
    speed.rounds.setValue(2)
    speed.block.setValue(2)
    assert speed.compare_button.isEnabled()
    speed.compare_button.click()
    qtbot.waitUntil(lambda: speed.compare is None and "Compare done" in speed.compare_status.text(),
                    timeout=STEP_TIMEOUT_MS)  # fmt: skip
    measured = speed.results["metadata_cache"].text()
    assert "rounds" in measured and ("faster" in measured or "slower" in measured) and "±" in measured
    assert "over 2 rounds" in speed.results["checkpointing"].text()
    assert speed.results["moe_routing"].text().startswith("nothing to do: no MoE")
    assert window.run_panel.charts.marks, "the switches Compare flipped are marked on the tokens/s chart"
    saved += [save_page(window, "Run"), save_page(window, "Speed")]
    window.run_panel.stop_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.FINISHED, timeout=STEP_TIMEOUT_MS)
    runs = window.pages.widget(window.page_titles().index("Runs")) if "Runs" in window.page_titles() else None
    if runs is not None:  # the run history page, when installed, shows this run's curve
        runs.select_runs([record.id for record in runs.records])
    saved += [save_page(window, title) for title in window.page_titles() if title not in MAIN_PAGES]  # Runs, Chat
    assert all(path.stat().st_size > 10_000 for path in saved)
