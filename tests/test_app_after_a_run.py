"""After a run: Chat offers the run that just finished, and Export's "Open folder" says where the folder is when no
file manager opens it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from PySide6.QtGui import QDesktopServices

from engine.run.registry import Registry

pytest_plugins = ["app_fixtures"]


def finished_run(registry: Registry, folder: Path) -> None:
    """A finished run with an adapter, listed after (newer than) the runs before it."""
    time.sleep(0.01)
    (folder / "adapter").mkdir(parents=True)
    (folder / "adapter" / "adapter_config.json").write_text("{}")
    registry.upsert(folder, name=folder.name, status="finished", model="demo")


def test_chat_selects_a_run_as_soon_as_it_finishes(qtbot: Any, tmp_path: Path) -> None:
    from app.pages.chat import ChatView

    registry = Registry(tmp_path / "runs.db")
    finished_run(registry, tmp_path / "older")
    finished_run(registry, tmp_path / "old")
    view = ChatView(registry, device="cpu")
    qtbot.addWidget(view)
    view.runs.setCurrentIndex(view.runs.findData(str((tmp_path / "older").resolve())))  # the user picks one
    view.refresh_runs()
    assert Path(view.runs.currentData()).name == "older", "no new run: the user's choice stays"
    finished_run(registry, tmp_path / "new")
    view.refresh_runs()  # what the window does when a run ends
    assert Path(view.runs.currentData()).name == "new"


def test_open_folder_says_where_the_folder_is_when_no_file_manager_opens_it(
    qtbot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.pages.export import ExportDialog

    monkeypatch.setattr(QDesktopServices, "openUrl", lambda url: False)  # no file manager set up
    dialog = ExportDialog(tmp_path, "run")
    qtbot.addWidget(dialog)
    dialog.result = tmp_path / "export"
    dialog.result.mkdir()
    dialog.open_folder()
    assert "No file manager" in dialog.status.text() and str(dialog.result) in dialog.status.text()
