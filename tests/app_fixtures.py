"""Qt fixtures for the app tests: the main window on the demo, and a guard against QThreads left running.

Load them in a test module with ``pytest_plugins = ["app_fixtures"]``; the guard is then autouse. A QThread
still running after a test would keep training (or crash) during the next one.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from hang import HANG_MS
from PySide6.QtCore import QThread


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
        thread.wait(10_000)  # type: ignore[union-attr]  # spare the next test, then fail this one
    assert not running, f"test left {len(running)} QThread(s) running: {running}"


@pytest.fixture
def window(qtbot: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The main window with its run folder and run history under tmp_path; closed (run stopped, threads joined)."""
    from PySide6.QtCore import QSettings

    from app.main_window import MainWindow

    monkeypatch.setenv("TUNEDECK_HOME", str(tmp_path / "home"))
    settings = QSettings(str(tmp_path / "window.ini"), QSettings.Format.IniFormat)
    win = MainWindow(detect_on_show=False, settings=settings)
    win.setup_panel.form.editor("output.dir").setText(str(tmp_path / "runs"))
    qtbot.addWidget(win)
    win.show()
    yield win
    win.close()  # stops the run and any report being measured; background jobs end at their next batch
    qtbot.waitUntil(lambda: not win.tasks.busy(), timeout=HANG_MS)
