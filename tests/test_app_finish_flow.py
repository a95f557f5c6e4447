"""A demo run that finishes in the window is, in the same session, chatted with and exported: the Chat and Runs
pages list it as soon as it ends (no restart), and the export dialog writes the adapter and the merged model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app_demo import LOAD_TIMEOUT_MS, prepare_demo
from app_finish import chat_with, export_from_runs
from hang import HANG_MS

from app.background import run_controller as rc
from engine.events import RunFinished

pytest_plugins = ["app_fixtures"]

RUN_TIMEOUT_MS = HANG_MS


def test_a_finished_demo_run_is_chatted_with_and_exported(qtbot: Any, window: Any, tmp_path: Path) -> None:
    chat, runs = window.page("Chat"), window.page("Runs")
    assert chat.runs.count() == 0 and runs.table.rowCount() == 0
    prepare_demo(qtbot, window, max_steps=8)
    ends: list[RunFinished] = []
    window.controller.run_event.connect(lambda e: ends.append(e) if isinstance(e, RunFinished) else None)
    window.run_panel.start_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.FINISHED, timeout=LOAD_TIMEOUT_MS + RUN_TIMEOUT_MS)
    finished = ends[-1]
    assert not finished.cancelled and finished.step == 8

    assert window.run_panel.export_button.isEnabled(), "the Run page exports the run that just ended"
    window.run_panel.export_button.click()
    assert window.run_panel.export_dialog.run_folder == Path(finished.run_dir)
    window.run_panel.export_dialog.reject()

    reply = chat_with(qtbot, window, finished.run_dir)
    assert reply.strip(), "the fine-tuned model answered"

    adapter = export_from_runs(qtbot, window, finished.run_dir, "adapter", tmp_path / "adapter")
    assert (adapter / "adapter_model.safetensors").exists() and (adapter / "README.md").exists()
    merged = export_from_runs(qtbot, window, finished.run_dir, "merged", tmp_path / "merged")
    assert json.loads((merged / "config.json").read_text())["architectures"]
    assert list(merged.glob("*.safetensors")) and not (merged / "adapter_config.json").exists()
