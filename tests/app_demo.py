"""Driving the main window through the demo set-up, shared by the app tests."""

from __future__ import annotations

from typing import Any

from hang import HANG_MS

LOAD_TIMEOUT_MS = HANG_MS
"""Loading torch, the demo model and tokenizing the dataset on a busy two-core machine."""


def prepare_demo(qtbot: Any, win: Any, max_steps: int) -> None:
    """Detect the machine, pick the demo model and data, and set a short run (no intermediate checkpoints)."""
    from engine.demo import DEMO_TRAIN_FILE

    win.hardware_panel.detect()
    qtbot.waitUntil(lambda: win.state.hardware is not None, timeout=LOAD_TIMEOUT_MS)
    win.model_panel.choose("demo")
    qtbot.waitUntil(lambda: win.state.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    win.data_panel.load(str(DEMO_TRAIN_FILE))
    qtbot.waitUntil(lambda: win.state.data_report is not None, timeout=LOAD_TIMEOUT_MS)
    form = win.setup_panel.form
    # evaluation only at the end (eval_every empty would be automatic)
    form.set_values({"training.max_steps": max_steps, "training.save_every": 0, "training.eval_every": 0})
    # the demo data loaded for the demo model and the gallery's planning run in threads too: let them end, so a
    # run's timing is measured alone
    qtbot.waitUntil(lambda: not win.tasks.busy(), timeout=LOAD_TIMEOUT_MS)
