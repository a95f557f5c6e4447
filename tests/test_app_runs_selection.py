"""The Runs page keeps the runs a user selected (by run id) across its refreshes, every few seconds, even when a new
run appears above them or one of them is deleted elsewhere."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtCore import QItemSelectionModel

from engine.run.registry import Registry

pytest_plugins = ["app_fixtures"]


def add_run(registry: Registry, folder: Path, name: str) -> str:
    time.sleep(0.01)  # newest first: each run a little later than the one before
    return registry.upsert(folder / name, name=name, model="demo", dataset="train.jsonl", status="finished", steps=5)


@pytest.fixture
def view(qtbot: Any, tmp_path: Path) -> Any:
    from app.pages.runs import RunsView

    registry = Registry(tmp_path / "runs.db")
    for name in ("first", "second", "third", "fourth"):
        add_run(registry, tmp_path, name)
    widget = RunsView(registry)
    widget.timer.stop()  # the test refreshes it itself
    qtbot.addWidget(widget)
    widget.show()
    return widget


def ctrl_select(view: Any, *names: str) -> None:
    """Select rows as a user does with Ctrl+click, one after the other."""
    model = view.table.selectionModel()
    rows = [index for index, record in enumerate(view.records) if record.name in names]
    view.table.selectRow(rows[0])
    for row in rows[1:]:
        flags = QItemSelectionModel.SelectionFlag.Select | QItemSelectionModel.SelectionFlag.Rows
        model.select(view.table.model().index(row, 0), flags)


def selected_names(view: Any) -> set[str]:
    return {record.name for record in view.selected_records()}


def test_a_refresh_keeps_a_multi_selection(view: Any) -> None:
    ctrl_select(view, "first", "third", "fourth")
    assert selected_names(view) == {"first", "third", "fourth"}
    view.refresh()
    assert selected_names(view) == {"first", "third", "fourth"}
    assert len(view.curves) == 3, "the chart still overlays every selected run"


def test_the_selection_follows_its_runs_when_a_new_run_appears_and_another_goes(view: Any, tmp_path: Path) -> None:
    ctrl_select(view, "first", "third")
    add_run(view.registry, tmp_path, "fifth")  # listed first: every row below it moves down
    view.refresh()
    assert selected_names(view) == {"first", "third"}
    second = next(record for record in view.records if record.name == "second")
    view.registry.delete(second.id, remove_folder=False)
    view.refresh()
    assert selected_names(view) == {"first", "third"}
    assert not view.rename_button.isEnabled(), "two runs selected: rename is for one"


def test_select_runs_selects_every_run_asked_for(view: Any) -> None:
    wanted = [record.id for record in view.records if record.name in ("second", "fourth")]
    view.select_runs(wanted)
    assert selected_names(view) == {"second", "fourth"}
    view.refresh()
    assert selected_names(view) == {"second", "fourth"}
