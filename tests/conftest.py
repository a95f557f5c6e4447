"""Shared fixtures: tiny models and tokenizers built from configs in milliseconds, never downloaded.

The Qt set-up (a display-less screen, throwaway window settings, pytest-qt's application) applies only where PySide6
imports: the GPU machine has no Qt, and there the modules that need it are not collected (``collect_ignore``), so
``pytest -m gpu`` runs everything else.
"""

from __future__ import annotations

import ast
import gc
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import build_model, build_tokenizer, write_jsonl

# Qt without a display, on one 1920x1200 screen (offscreen's own is 800x800: a window restored from saved settings
# would be cut down to it).
_SCREEN = Path(tempfile.mkdtemp(prefix="tunedeck-screen-")) / "screen.json"
_SCREEN.write_text('{"screens": [{"name": "test", "x": 0, "y": 0, "width": 1920, "height": 1200}]}')
os.environ.setdefault("QT_QPA_PLATFORM", f"offscreen:configfile={_SCREEN}")
os.environ.setdefault("TUNEDECK_HOME", tempfile.mkdtemp(prefix="tunedeck-home-"))  # never the user's run registry
# One compile cache for the whole test run, fresh at its start and shared by the workers and every process they
# start: many tests compile the same tiny models' kernels, and a run keeps a folder chosen before it starts.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(os.environ["TUNEDECK_HOME"]) / "compile_cache" / "inductor"))
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # pytest-xdist (`-n 2`): this process is one of several
if _WORKER:
    # Workers inherit the first process's variables: each gets a data folder of its own (run history, compile cache),
    # and its share of the cores for torch's thread pool and inductor's compile workers (children such as the ranks
    # of a run inherit both). Two pools of two threads on two cores spin against each other (a set of training tests
    # took 93 s instead of 39 s), and a pool of compile processes per worker costs more than it saves (the compiling
    # tests of two files: 262 s instead of 115 s).
    os.environ["TUNEDECK_HOME"] = str(Path(os.environ["TUNEDECK_HOME"]) / _WORKER)
    _share = str(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    os.environ.setdefault("OMP_NUM_THREADS", _share)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", _share)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    from PySide6.QtCore import QSettings  # (after QT_QPA_PLATFORM)
except ImportError:  # no Qt here (the GPU machine): only the tests that need no Qt are collected
    HAS_QT = False
else:
    HAS_QT = True

_QT_MODULES = {"PySide6", "pytestqt", "app"}
"""Top-level imports that need Qt: PySide6, pytest-qt and the desktop app."""
_TESTS = Path(__file__).parent


def _needs_qt(name: str, seen: set[str] | None = None) -> bool:
    """Whether tests/``name``.py imports Qt at module level (or loads it as a plugin, ``pytest_plugins``), itself or
    through another module of tests/."""
    seen = set() if seen is None else seen
    path = _TESTS / f"{name}.py"
    if name in seen or not path.is_file():
        return False
    seen.add(name)
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            imported = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported = [node.module]
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytest_plugins" for t in node.targets):
            constants = [c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)]
            imported = [value for value in constants if isinstance(value, str)]
        else:
            continue
        for module in imported:
            top = module.split(".")[0]
            if top in _QT_MODULES or _needs_qt(top, seen):
                return True
    return False


try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the GPU machine runs without hypothesis (its tests are not selected there)
    pass
else:
    # A busy machine slows every example alike: no per-example deadline and no too-slow check, anywhere.
    settings.register_profile("tunedeck", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("tunedeck")

collect_ignore: list[str] = []
"""Without Qt, the test modules that import it are left out of collection (they would fail to import)."""
if not HAS_QT:
    collect_ignore = [path.name for path in sorted(_TESTS.glob("test_*.py")) if _needs_qt(path.stem)]
else:
    # The window's remembered size and page go to a throwaway folder, never the user's settings.
    QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, tempfile.mkdtemp(prefix="tunedeck-qt-"))


@pytest.fixture(autouse=True)
def collect_garbage_between_tests() -> Iterator[None]:
    """With the automatic collector off (once a Qt test ran), a test's cyclic garbage, widgets included, is
    collected here on the main thread before the next test starts its worker threads: the young generations, where
    it still is (a full collection after every test added minutes to the suite); the application's timer collects
    the oldest one when it is due."""
    yield
    if not gc.isenabled():
        gc.collect(1)


if HAS_QT:

    @pytest.fixture(scope="session")
    def qapp(qapp: Any) -> Any:
        """pytest-qt's QApplication, collecting garbage on its GUI thread only, as app.background.gui_gc does."""
        from app.background.gui_gc import collect_on_gui_thread

        collect_on_gui_thread(qapp)
        return qapp

    @pytest.fixture(autouse=True)
    def throwaway_window_settings(tmp_path_factory: pytest.TempPathFactory) -> None:
        """Each test starts with no remembered window state (size, page), as on a first start."""
        folder = tmp_path_factory.mktemp("qt-settings")
        QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, str(folder))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (hidden 64) with its tokenizer, as a local Hugging Face folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    build_tokenizer(folder)
    vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3
    build_model(folder, vocab)
    return folder


@pytest.fixture
def chat_file(tmp_path: Path) -> Path:
    rows = [
        {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"number {i}"}]}
        for i in range(24)
    ]
    return write_jsonl(tmp_path / "chat.jsonl", rows)
