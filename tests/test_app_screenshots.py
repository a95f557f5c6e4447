"""Screenshots of every page, in the light and the dark look, during and after a demo run; and the Speed page's
Compare and all on vs all off on that run.

The pictures are what the README shows: ``docs/screenshots/light/<page>.png`` and ``docs/screenshots/dark/...``,
rewritten by ``TUNEDECK_SCREENSHOTS=docs/screenshots .venv/bin/python -m pytest tests/test_app_screenshots.py``.
Without that variable they go to the test's temporary folder, so a test run never changes the repository's files.
They are stored with a reduced palette to keep the repository small.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from app_demo import LOAD_TIMEOUT_MS, prepare_demo
from app_finish import chat_with, export_from_runs
from hang import HANG_MS
from PySide6.QtCore import Qt
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QApplication, QWidget

from app.background import run_controller as rc
from app.background.ab_compare import ALL, SWITCHES
from engine.events import RunFinished, StepMetrics

pytest_plugins = ["app_fixtures"]

STEP_TIMEOUT_MS = HANG_MS
SIZE = (1280, 820)


def fewer_colors(image: QImage) -> QImage:
    """The image on a palette of its 256 most common colours: a third of the file size; the page's flat colours
    stay exact (no dithering noise) and only rare anti-aliasing shades move to their nearest neighbour."""
    rgb = image.convertToFormat(QImage.Format.Format_RGB32)
    pixels = np.frombuffer(rgb.constBits(), np.uint32, count=rgb.bytesPerLine() // 4 * rgb.height())
    colors, counts = np.unique(pixels, return_counts=True)
    table = [int(color) for color in colors[np.argsort(counts)[::-1][:256]]]
    return rgb.convertToFormat(QImage.Format.Format_Indexed8, table, Qt.ImageConversionFlag.ThresholdDither)


def save(widget: QWidget, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    assert fewer_colors(widget.grab().toImage()).save(str(path), "PNG", 9), f"could not write {path}"
    return path


def screenshots_folder(tmp_path: Path) -> Path:
    """``$TUNEDECK_SCREENSHOTS`` (``docs/screenshots`` to rewrite the README's pictures), else a throwaway folder."""
    chosen = os.environ.get("TUNEDECK_SCREENSHOTS")
    return Path(chosen) if chosen else tmp_path / "screenshots"


def save_pages(window: Any, look: str, folder: Path) -> list[Path]:
    window.set_look(look == "dark")
    QApplication.processEvents()  # the new palette reaches the widgets through posted events
    saved = []
    charts = window.run_panel.charts
    for title in window.page_titles():
        window.show_page(title)
        charts.redraw_all()
        if title == "Run" and charts.marks:  # as when the pointer rests on the last change
            charts.show_mark_near(charts.marks[-1][0])
        saved.append(save(window, folder / look / f"{title.lower().replace(' ', '-')}.png"))
    dialog = window.page("Runs").export_dialog
    if dialog is not None:
        saved.append(save(dialog, folder / look / "export.png"))
    return saved


def compare_on_the_run(qtbot: Any, window: Any) -> None:
    """Compare the switches one by one, then all on vs all off, on the running demo."""
    speed = window.speed_panel
    speed.rounds.setValue(2)
    speed.block.setValue(2)
    assert speed.compare_button.isEnabled()
    # Every switch but fused kernels: on a CPU they compile C++ with the system compiler, 30 s on an idle machine
    # and many minutes on a busy one, which is not what this tour is for (tests/test_app_soak.py trains compiled).
    speed.start_compare([name for name in SWITCHES if name != "fused_kernels"])
    qtbot.waitUntil(lambda: speed.compare is None, timeout=STEP_TIMEOUT_MS)  # done, or the run ended first
    assert "Compare done" in speed.compare_status.text(), speed.compare_status.text()
    measured = speed.results["metadata_cache"].text()
    assert "%" in measured and "±" in measured, measured
    assert "over 2 rounds" in speed.results["fused_loss"].toolTip()
    assert speed.results["checkpointing"].text() == "not applicable here", "offloading on a CPU run: no such thing"
    assert speed.results["moe_routing"].text() == "nothing to do here"
    speed.all_button.click()
    qtbot.waitUntil(lambda: speed.compare is None, timeout=STEP_TIMEOUT_MS)
    assert ALL in speed.measured, speed.compare_status.text()
    assert "All speed switches together: " in speed.compare_status.text()
    assert window.run_panel.charts.marks, "the switches Compare flipped are marked on the tokens/s chart"


def test_screenshots_of_every_page_in_light_and_dark(qtbot: Any, window: Any, tmp_path: Path) -> None:
    window.resize(*SIZE)
    window.setup_view.refresh()  # the GPU setup page's detection, as at a real start
    # room for Compare however far the run gets ahead of a busy window (it is stopped once Compare is done)
    prepare_demo(qtbot, window, max_steps=600)
    steps: list[int] = []
    ends: list[RunFinished] = []
    window.controller.run_event.connect(lambda e: steps.append(e.step) if isinstance(e, StepMetrics) else None)
    window.controller.run_event.connect(lambda e: ends.append(e) if isinstance(e, RunFinished) else None)
    speed = window.speed_panel
    assert not speed.metadata_box.isEnabled(), "switches act on a live run only"
    assert speed.reasons["metadata_cache"].text().startswith("Will be on — ")
    assert speed.reasons["moe_routing"].text() == "Not here — this model has no MoE expert layers"
    window.run_panel.start_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.RUNNING, timeout=LOAD_TIMEOUT_MS)
    qtbot.waitUntil(lambda: len(steps) >= 4, timeout=STEP_TIMEOUT_MS)
    assert speed.metadata_box.isEnabled()
    assert speed.reasons["fused_kernels"].text().startswith("Off — TuneDeck's choice: on CPU")
    compare_on_the_run(qtbot, window)
    window.run_panel.stop_button.click()
    qtbot.waitUntil(lambda: window.controller.state == rc.FINISHED, timeout=STEP_TIMEOUT_MS)
    run_dir = ends[-1].run_dir
    chat_with(qtbot, window, run_dir, "Is 7 greater than 3?")
    export_from_runs(qtbot, window, run_dir, "adapter", tmp_path / "adapter")
    qtbot.waitUntil(lambda: window.setup_view.driver is not None, timeout=LOAD_TIMEOUT_MS)
    window.page("Runs").select_runs([record.id for record in window.page("Runs").records])
    folder = screenshots_folder(tmp_path)
    saved = save_pages(window, "light", folder) + save_pages(window, "dark", folder)
    window.set_look(False)
    assert len(saved) == 2 * (len(window.page_titles()) + 1)
    assert all(path.stat().st_size > 10_000 for path in saved)
