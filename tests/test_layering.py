"""The engine never imports Qt: it runs headless, on the GPU machine and in the CLI without PySide6."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

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
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_cli_help_does_not_load_torch() -> None:
    code = "import sys\nfrom engine.cli import main\nmain([])\nassert 'torch' not in sys.modules\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
