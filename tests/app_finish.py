"""The second half of the guided flow, shared by the app tests: a run that just finished in this window is
chatted with on the Chat page and exported from the Runs page, without restarting anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hang import HANG_MS

CHAT_TIMEOUT_MS = HANG_MS
EXPORT_TIMEOUT_MS = HANG_MS


def chat_with(qtbot: Any, window: Any, run_dir: str, prompt: str = "What is 2 + 3?") -> str:
    """Pick the finished run on the Chat page (listed since it ended), load it, and return its reply."""
    chat = window.page("Chat")
    window.show_page("Chat")
    index = chat.runs.findData(run_dir)
    assert index >= 0, f"the Chat page does not list the run that just ended ({run_dir})"
    chat.runs.setCurrentIndex(index)
    chat.max_tokens.setValue(16)
    chat.compare.setChecked(True)
    qtbot.waitUntil(chat.load_button.isEnabled, timeout=CHAT_TIMEOUT_MS)  # a last load's end comes queued
    chat.load_button.click()
    qtbot.waitUntil(lambda: chat.chat is not None and chat.send_button.isEnabled(), timeout=CHAT_TIMEOUT_MS)
    chat.prompt.setText(prompt)
    chat.send_button.click()
    qtbot.waitUntil(lambda: len(chat.histories["base"]) == 2 and not chat._busy(), timeout=CHAT_TIMEOUT_MS)
    assert chat.status.text() == "done"
    return chat.histories["tuned"][-1]["content"]


def export_from_runs(qtbot: Any, window: Any, run_dir: str, kind: str, target: Path) -> Path:
    """Select the run on the Runs page (listed since it ended), export it, and return what was written."""
    runs = window.page("Runs")
    window.show_page("Runs")
    ids = [record.id for record in runs.records if record.folder == run_dir]
    assert ids, f"the Runs page does not list the run that just ended ({run_dir})"
    runs.select_runs(ids)
    assert runs.export_button.isEnabled()
    dialog = runs.export_selected()
    dialog.kinds[kind].setChecked(True)
    dialog.target.setText(str(target))
    dialog.export_button.click()
    qtbot.waitUntil(lambda: not dialog.busy() and dialog.export_button.isEnabled(), timeout=EXPORT_TIMEOUT_MS)
    assert dialog.error.text() == "", dialog.error.text()
    assert dialog.open_button.isEnabled() and dialog.result == target
    return dialog.result
