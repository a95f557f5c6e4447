"""The chat page offscreen: load a run, stream tuned and base replies side by side, stop a reply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from app_fixtures import no_dangling_qthreads  # noqa: F401
from hang import HANG_MS
from test_chat import train_tiny_run

from engine.run.registry import Registry

SCREENSHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"
TIMEOUT_MS = HANG_MS


@pytest.fixture(scope="module")
def run_folder(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_model_dir, tmp_path_factory.mktemp("chat-view"))


@pytest.fixture
def view(qtbot: Any, run_folder: Path, tmp_path: Path) -> Any:
    from app.pages.chat import ChatView

    registry = Registry(tmp_path / "runs.db")
    registry.upsert(run_folder, name="tiny chat run", status="finished", model="tiny-llama")
    widget = ChatView(registry, device="cpu")
    widget.resize(1000, 600)
    qtbot.addWidget(widget)
    widget.show()
    yield widget
    widget.close()


def load(qtbot: Any, view: Any) -> None:
    view.load_button.click()
    qtbot.waitUntil(lambda: view.chat is not None, timeout=TIMEOUT_MS)
    qtbot.waitUntil(lambda: view.send_button.isEnabled(), timeout=TIMEOUT_MS)


def test_picker_lists_runs_with_an_adapter(view: Any, run_folder: Path) -> None:
    assert view.runs.count() == 1
    assert view.runs.currentData() == str(run_folder.resolve())
    assert "tiny chat run" in view.runs.currentText()
    assert not view.send_button.isEnabled()


def test_tuned_and_base_replies_stream_side_by_side(qtbot: Any, view: Any) -> None:
    from engine.model.chat import GenerationSettings, reply

    load(qtbot, view)
    view.temperature.setValue(0)
    view.max_tokens.setValue(30)
    pieces: list[tuple[str, str]] = []
    show_piece = view._piece

    def record_piece(side: str, text: str) -> None:
        pieces.append((side, text))
        show_piece(side, text)

    view._piece = record_piece
    view.prompt.setText("say 3")
    view.send_button.click()
    qtbot.waitUntil(lambda: not view.worker.isRunning() and view.send_button.isEnabled(), timeout=TIMEOUT_MS)
    greedy = GenerationSettings(temperature=0, max_new_tokens=30)
    prompt = [{"role": "user", "content": "say 3"}]
    tuned = reply(view.chat, prompt, greedy)
    base = reply(view.chat, prompt, greedy, use_adapter=False)
    assert tuned != base
    assert view.histories["tuned"][-1] == {"role": "assistant", "content": tuned}
    assert view.histories["base"][-1] == {"role": "assistant", "content": base}
    assert tuned in view.panes["tuned"].toPlainText()
    assert base in view.panes["base"].toPlainText()
    assert "say 3" in view.panes["tuned"].toPlainText()
    assert len([p for p in pieces if p[0] == "tuned"]) > 1
    assert view.status.text() == "done"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    assert view.grab().save(str(SCREENSHOTS / "chat_view.png"))


def test_stop_ends_the_reply_and_skips_the_base_one(qtbot: Any, view: Any) -> None:
    load(qtbot, view)
    view.temperature.setValue(0)
    view.max_tokens.setValue(4000)
    view.send("say 3")
    assert view.stop_button.isEnabled()
    qtbot.waitUntil(lambda: view.panes["tuned"].toPlainText().count("b") >= 2, timeout=TIMEOUT_MS)
    view.stop_button.click()
    qtbot.waitUntil(lambda: not view.worker.isRunning(), timeout=TIMEOUT_MS)
    qtbot.waitUntil(lambda: view.send_button.isEnabled(), timeout=TIMEOUT_MS)
    answer = view.histories["tuned"][-1]["content"]
    assert 2 <= len(answer) < 1000
    assert view.histories["base"][-1]["role"] == "user"  # the base reply never started
    assert view.status.text() == "stopped"
    assert not view.stop_button.isEnabled()


def test_a_folder_without_adapter_reports_an_error(qtbot: Any, view: Any, tmp_path: Path) -> None:
    view.load_run(str(tmp_path))
    qtbot.waitUntil(lambda: view.status.text().startswith("error:"), timeout=TIMEOUT_MS)
    assert "no finished adapter" in view.status.text()
    assert view.chat is None
