"""Every page fits a 1366x768 laptop screen and the window never grows itself.

Long pages scroll inside the window instead of raising its smallest size: a window that grows itself puts the
bottom of every page off-screen (the Model page's gallery once made it 1109 pixels high on a 1000-pixel screen).
The test runs in this process (on the tests' larger screen, where a growing window is not held back) and again in
a fresh process whose only screen is 1366x768.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from app_demo import LOAD_TIMEOUT_MS, prepare_demo
from hang import HANG_S

pytest_plugins = ["app_fixtures"]

LAPTOP = (1366, 768)
ON_LAPTOP_SCREEN = "TUNEDECK_TEST_LAPTOP_SCREEN"
"""Set in the fresh process the second run starts: its only screen is 1366x768."""


def test_every_page_fits_a_laptop_screen_and_the_window_never_grows(qtbot: Any, window: Any) -> None:
    room = window.screen().availableGeometry()
    if os.environ.get(ON_LAPTOP_SCREEN):
        assert (room.width(), room.height()) == LAPTOP
    limit = (min(LAPTOP[0], room.width()), min(LAPTOP[1], room.height()))
    prepare_demo(qtbot, window, max_steps=5)
    gallery = window.model_panel.gallery
    gallery.card.setCurrentIndex(gallery.card.findData("RTX 4090"))  # every model of the gallery, planned
    qtbot.waitUntil(lambda: "RTX 4090" in gallery.note.text() and len(gallery.rows) > 10, timeout=LOAD_TIMEOUT_MS)
    window.resize(*limit)
    for title in [*window.page_titles(), *reversed(window.page_titles())]:
        window.show_page(title)
        qtbot.wait(20)  # layouts settle on the next pass of the event loop
        page = window.pages.currentWidget()
        least = page.minimumSizeHint()
        assert least.width() <= limit[0] and least.height() <= limit[1], f"{title} needs {least.toTuple()}"
        size = window.size()
        assert size.width() <= limit[0] and size.height() <= limit[1], f"{title} grew the window to {size.toTuple()}"
        smallest = window.minimumSizeHint()
        assert smallest.width() <= limit[0] and smallest.height() <= limit[1], f"on {title}: {smallest.toTuple()}"
    assert (window.width(), window.height()) == limit, "the window keeps the size it was given"


def test_on_a_1366x768_screen_too(tmp_path: Path) -> None:
    """The same test in a fresh process whose only screen is a laptop's."""
    screen = tmp_path / "screen.json"
    screen.write_text('{"screens": [{"name": "laptop", "x": 0, "y": 0, "width": 1366, "height": 768}]}')
    env = {**os.environ, "QT_QPA_PLATFORM": f"offscreen:configfile={screen}", ON_LAPTOP_SCREEN: "1"}
    env["TUNEDECK_HOME"] = tempfile.mkdtemp(prefix="tunedeck-home-", dir=tmp_path)
    test = f"{Path(__file__)}::test_every_page_fits_a_laptop_screen_and_the_window_never_grows"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        env=env, capture_output=True, text=True, timeout=HANG_S, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
