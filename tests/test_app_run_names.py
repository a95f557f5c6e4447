"""The app's run names, with real widgets: the settings form's run-name field and the Runs page's rename dialog say
why a name is refused and hold Start and OK back until it is one plain folder name; Delete leaves a user's file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hang import HANG_MS
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDialogButtonBox

from engine.config import run_name_problem
from engine.run.ownership import MARKER_FILE, write_marker
from engine.run.registry import Registry

pytest_plugins = ["app_fixtures"]

BAD = ["..", "a/b", "CON", "x.", "what?"]


@pytest.mark.parametrize("name", BAD)
def test_the_run_name_field_shows_why_a_name_is_refused(qtbot: Any, name: str) -> None:
    from app.widgets.config_form import ConfigForm

    form = ConfigForm(frozenset({"model.name", "data.path"}))
    qtbot.addWidget(form)
    form.set_advanced_visible(True)
    form.show()
    field, problem = form.editor("output.name"), form.problems["output.name"]
    qtbot.keyClicks(field, name)
    assert problem.isVisible() and problem.text() == f"Run name {run_name_problem(name)}"
    assert form.field_problem("output.name") == problem.text()
    field.clear()  # empty: the default name, which is fine
    assert not problem.isVisible() and form.field_problem("output.name") is None
    qtbot.keyClicks(field, "my run")
    assert not problem.isVisible() and form.values()["output"]["name"] == "my run"


def test_start_waits_for_a_good_run_name(qtbot: Any, window: Any, tmp_path: Path) -> None:
    from engine.demo import DEMO_TRAIN_FILE

    win = window
    win.state.set_data(str(DEMO_TRAIN_FILE), None)
    recipe = win.setup_panel
    field = recipe.form.editor("output.name")
    field.setText("..")
    qtbot.waitUntil(lambda: not recipe.step_status()[0], timeout=HANG_MS)  # the check runs once typing pauses
    assert "output.name: '..' is the output folder's parent" in recipe.step_status()[1]
    assert not win.guide.start_button.isEnabled()
    assert ("Recipe", recipe.step_status()[1]) in win.guide.missing()
    win.run_panel.start()  # the Run page's own Start button refuses too, saying why
    assert "output.name" in win.run_panel.error.text() and "parent" in win.run_panel.error.text()
    assert not win.controller.active
    assert {path.name for path in tmp_path.iterdir()} <= {"home", "window.ini"}, "no run folder, no config.json"
    field.setText("good name")
    qtbot.waitUntil(lambda: recipe.step_status()[0], timeout=HANG_MS)
    assert ("Recipe", recipe.step_status()[1]) not in win.guide.missing()


def recorded_run(tmp_path: Path, name: str = "old") -> tuple[Registry, str, Path]:
    registry = Registry(tmp_path / "runs.db")
    folder = tmp_path / "runs" / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}", encoding="utf-8")
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n', encoding="utf-8")
    run_id = registry.upsert(folder, name=name, status="finished", steps=1)
    write_marker(folder, run_id)
    return registry, run_id, folder


def test_the_rename_dialog_holds_ok_back_until_the_name_is_good(qtbot: Any, tmp_path: Path) -> None:
    from app.pages.runs import RunsView

    registry, run_id, _ = recorded_run(tmp_path)
    view = RunsView(registry)
    qtbot.addWidget(view)
    view.select_runs([run_id])
    view.rename_button.click()
    dialog = view.rename_dialog
    assert dialog is not None and dialog.isVisible() and dialog.field.text() == "old"
    ok = dialog.buttons.button(QDialogButtonBox.StandardButton.Ok)
    for bad in BAD:
        dialog.field.setText(bad)
        assert not ok.isEnabled() and dialog.problem.text() == f"The name {run_name_problem(bad)}."
        qtbot.keyClick(dialog.field, Qt.Key.Key_Return)  # Enter is refused as OK is
        assert dialog.isVisible() and registry.get(run_id).name == "old"
    dialog.field.setText("  better ")
    assert ok.isEnabled() and not dialog.problem.isVisible()
    ok.click()
    qtbot.waitUntil(lambda: registry.get(run_id).name == "better", timeout=HANG_MS)
    assert view.message.text() == "renamed to better"


def test_a_bad_name_passed_to_rename_is_an_error_on_the_page(qtbot: Any, tmp_path: Path) -> None:
    from app.pages.runs import RunsView

    registry, run_id, _ = recorded_run(tmp_path)
    view = RunsView(registry)
    qtbot.addWidget(view)
    view.select_runs([run_id])
    view.rename_selected("../x")
    assert view.message.text().startswith("error: the run name '../x' contains '/'")
    assert registry.get(run_id).name == "old"


def test_delete_on_the_runs_page_leaves_a_users_file_and_says_so(qtbot: Any, tmp_path: Path) -> None:
    from app.pages.runs import RunsView

    registry, run_id, folder = recorded_run(tmp_path)
    (folder / "notes.txt").write_text("mine\n", encoding="utf-8")
    view = RunsView(registry)
    qtbot.addWidget(view)
    view.select_runs([run_id])
    view.confirm_delete = lambda record: record.id == run_id
    view.delete_selected()
    assert sorted(path.name for path in folder.iterdir()) == ["notes.txt"]
    assert (folder / "notes.txt").read_text(encoding="utf-8") == "mine\n"
    assert "notes.txt: not written by TuneDeck" in view.message.text()
    assert registry.runs() == [] and view.table.rowCount() == 0
    assert not (folder / MARKER_FILE).exists()
