"""The engine never imports Qt: it runs headless, on the GPU machine and in the CLI without PySide6. The app keeps
its modules in folders by role (pages/, widgets/, background/), with few left at its top level."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

from hang import HANG_S

import app
import engine


def engine_modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(engine.__path__, "engine.")]


def test_engine_modules_do_not_import_qt() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {engine_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('PySide6', 'shiboken6', 'pyqtgraph', 'app'))\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr


def test_cli_help_does_not_load_torch() -> None:
    code = "import sys\nfrom engine.cli import main\nmain([])\nassert 'torch' not in sys.modules\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr


APP_TOP_LEVEL_MODULES = 10
"""app/'s own top level: the entry point, the window, its state, theme and icon; a page, a widget or a thread goes
in its folder."""


def test_the_app_keeps_its_modules_in_folders() -> None:
    top_level = sorted(m.name for m in pkgutil.iter_modules(app.__path__) if not m.ispkg)
    assert len(top_level) <= APP_TOP_LEVEL_MODULES, f"app/ has {len(top_level)} top-level modules: {top_level}"
    folders = sorted(m.name for m in pkgutil.iter_modules(app.__path__) if m.ispkg)
    assert {"pages", "widgets", "background"} <= set(folders), folders
