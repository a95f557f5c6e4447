"""Shared fixtures: tiny models and tokenizers built from configs in milliseconds, never downloaded."""

from __future__ import annotations

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
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from PySide6.QtCore import QSettings  # noqa: E402  (after QT_QPA_PLATFORM)

# The window's remembered size and page go to a throwaway folder, never the user's settings.
QSettings.setPath(QSettings.Format.IniFormat, QSettings.Scope.UserScope, tempfile.mkdtemp(prefix="tunedeck-qt-"))


@pytest.fixture(scope="session")
def qapp(qapp: Any) -> Any:
    """pytest-qt's application, collecting garbage on its GUI thread only, as the app does (app.gui_gc)."""
    from app.gui_gc import collect_on_gui_thread

    collect_on_gui_thread(qapp)
    return qapp


@pytest.fixture(autouse=True)
def collect_garbage_between_tests() -> Iterator[None]:
    """With the automatic collector off (once a Qt test ran), a test's cyclic garbage, widgets included, is
    collected here on the main thread before the next test starts its worker threads: the young generations, where
    it still is (a full collection after every test added minutes to the suite); the application's timer collects
    the oldest one when it is due."""
    yield
    if not gc.isenabled():
        gc.collect(1)


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
