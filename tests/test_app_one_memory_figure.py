"""One model and one recipe show one predicted peak on every page: the Model table, the Model page's details, the
Recipe page and the Run page's plan (and one training time where two pages show it). The table's figure is the
Automatic recipe's, labelled so; the chosen recipe's figure is labelled with its name on every page."""

from __future__ import annotations

import re
from typing import Any

from app_demo import LOAD_TIMEOUT_MS

from engine.config import DEMO_MODEL
from engine.hardware.recipes import AUTOMATIC_RECIPE, DEMO_RECIPE

pytest_plugins = ["app_fixtures"]

PEAK = re.compile(r"(\d+\.\d) of (\d+\.\d) GiB")
TIME = re.compile(r"about ([^()]+?) \(")


def peaks(text: str) -> list[str]:
    """Every "X of Y GiB" figure in a page's text."""
    return [f"{peak} of {budget}" for peak, budget in PEAK.findall(text)]


def table_peak(window: Any, hub_id: str) -> list[str]:
    from app.widgets.model_gallery import PEAK_COLUMN

    gallery = window.model_panel.gallery
    row = next(i for i, r in enumerate(gallery.rows) if r.entry.hub_id == hub_id)
    header = gallery.table.horizontalHeaderItem(gallery.table.columnCount() - 3).text()
    assert header == PEAK_COLUMN == "Peak, Automatic recipe", "the table says which recipe its figure is for"
    return peaks(gallery.table.item(row, gallery.table.columnCount() - 3).text())


def choose(qtbot: Any, window: Any, hub_id: str) -> None:
    window.resize(1366, 768)
    window.hardware_panel.detect()
    qtbot.waitUntil(lambda: window.state.hardware is not None, timeout=LOAD_TIMEOUT_MS)
    qtbot.waitUntil(lambda: bool(window.model_panel.gallery.rows), timeout=LOAD_TIMEOUT_MS)
    window.model_panel.gallery.select(hub_id)
    window.model_panel.use.click()
    qtbot.waitUntil(lambda: window.state.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    qtbot.waitUntil(lambda: not window.tasks.busy(), timeout=LOAD_TIMEOUT_MS)


def assert_one_figure(window: Any, hub_id: str, recipe: str) -> None:
    """The chosen recipe's peak and time agree on the Model, Recipe and Run pages; the Automatic recipe's peak
    agrees in the table, the Model page's verdict and the Recipe page."""
    setup, model = window.setup_panel, window.model_panel
    assert setup.recipe_name() == recipe
    chosen = setup.estimates[recipe].text()
    [figure] = peaks(chosen)
    assert peaks(model.plan.text()) == [figure] and f"With the <b>{recipe}</b> recipe" in model.plan.text()
    run_plan = window.run_panel.plan.text()
    assert peaks(run_plan) == [figure] and f"({recipe} recipe)" in run_plan, run_plan
    assert TIME.findall(run_plan) == TIME.findall(chosen), (run_plan, chosen)
    [automatic] = peaks(setup.estimates[AUTOMATIC_RECIPE].text())
    assert table_peak(window, hub_id) == [automatic]
    details = model.details.toPlainText()
    assert f"predicted peak {automatic} GiB with the Automatic recipe" in details, details


def test_the_demo_shows_one_peak_for_its_recipe_on_every_page(qtbot: Any, window: Any) -> None:
    from engine.demo import DEMO_TRAIN_FILE

    choose(qtbot, window, DEMO_MODEL)
    window.data_panel.load(str(DEMO_TRAIN_FILE))
    qtbot.waitUntil(lambda: window.state.data_report is not None, timeout=LOAD_TIMEOUT_MS)
    qtbot.waitUntil(lambda: not window.tasks.busy(), timeout=LOAD_TIMEOUT_MS)
    assert_one_figure(window, DEMO_MODEL, DEMO_RECIPE)
    assert TIME.findall(window.run_panel.plan.text()), "with the data known, both pages say how long it trains"
    assert peaks(window.setup_panel.estimates[DEMO_RECIPE].text()) != table_peak(window, DEMO_MODEL), (
        "the demo's own recipe plans shorter rows than the Automatic one: two figures, each labelled"
    )
    window.setup_panel.choose_recipe("Quick test")
    qtbot.waitUntil(lambda: window.state.planned_recipe == "Quick test", timeout=LOAD_TIMEOUT_MS)
    assert_one_figure(window, DEMO_MODEL, "Quick test")


def test_a_gallery_model_shows_one_peak_on_every_page(qtbot: Any, window: Any) -> None:
    choose(qtbot, window, "Qwen/Qwen3-0.6B")  # its built-in shape: nothing is downloaded
    assert_one_figure(window, "Qwen/Qwen3-0.6B", AUTOMATIC_RECIPE)
