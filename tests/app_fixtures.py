"""Qt fixtures for the app tests: the main window on the demo, and a guard against QThreads left running.

Import the fixtures into a test module (``from app_fixtures import no_dangling_qthreads, window``); the guard
is autouse there. A QThread still running after a test would keep training (or crash) during the next one.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QThread

LOAD_TIMEOUT_MS = 120_000


@pytest.fixture(autouse=True)
def no_dangling_qthreads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail the test if any QThread it started is still running at its end."""
    started: list[weakref.ref[QThread]] = []
    original = QThread.start

    def start(self: QThread, *args: Any) -> None:
        started.append(weakref.ref(self))
        original(self, *args)

    monkeypatch.setattr(QThread, "start", start)
    yield
    running = [ref() for ref in started if ref() is not None and ref().isRunning()]  # type: ignore[union-attr]
    for thread in running:
        thread.wait(10_000)  # type: ignore[union-attr]
    assert not running, f"test left {len(running)} QThread(s) running: {running}"


@pytest.fixture
def window(qtbot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The main window with its run folder and run history under tmp_path; closed (run stopped, threads joined)."""
    from app.main_window import MainWindow

    monkeypatch.setenv("TUNEDECK_HOME", str(tmp_path / "home"))
    win = MainWindow(detect_on_show=False)
    win.setup_panel.form.editor("output.dir").setText(str(tmp_path / "runs"))
    qtbot.addWidget(win)
    win.show()
    yield win
    win.close()


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
    form.editor("training.max_steps").setValue(max_steps)
    form.editor("training.save_every").setValue(0)
    form.editor("training.eval_every").setValue(0)
