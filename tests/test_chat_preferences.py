"""Preferences from the Chat page, offscreen through the real widgets and a tiny model: pick the better of two
answers or edit one, the count, undo, export, and "Train on my preferences" as a DPO run in the window."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hang import HANG_MS
from test_chat import train_tiny_run

from engine.data.files import load_examples
from engine.data.preferences import PreferenceStore
from engine.run.registry import Registry

SCREENSHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"
TIMEOUT_MS = HANG_MS
RUN_TIMEOUT_MS = HANG_MS
pytest_plugins = ["app_fixtures"]  # the window fixture and the dangling-QThread guard


@pytest.fixture(scope="module")
def run_folder(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_model_dir, tmp_path_factory.mktemp("chat-preferences"))


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A data folder of the test's own: no pairs saved before it."""
    folder = tmp_path / "home"
    monkeypatch.setenv("TUNEDECK_HOME", str(folder))
    return folder


@pytest.fixture
def view(qtbot: Any, run_folder: Path, tmp_path: Path) -> Any:
    from app.pages.chat import ChatView

    registry = Registry(tmp_path / "runs.db")
    registry.upsert(run_folder, name="tiny chat run", status="finished", model="tiny-llama")
    widget = ChatView(registry, device="cpu")
    widget.resize(1100, 700)
    qtbot.addWidget(widget)
    widget.show()
    yield widget
    widget.close()


def load(qtbot: Any, view: Any) -> None:
    view.load_button.click()
    qtbot.waitUntil(lambda: view.chat is not None and view.send_button.isEnabled(), timeout=TIMEOUT_MS)


def ask(qtbot: Any, view: Any, text: str) -> None:
    """Two greedy answers to ``text``, waited for until the page offers them (or says why not)."""
    view.temperature.setValue(0)
    view.max_tokens.setValue(12)
    view.prompt.setText(text)
    view.send_button.click()
    qtbot.waitUntil(lambda: not view.worker.isRunning() and view.send_button.isEnabled(), timeout=TIMEOUT_MS)
    qtbot.waitUntil(lambda: view.preferences.choice_note.text() != "generating…", timeout=TIMEOUT_MS)


def test_the_better_answer_is_saved_as_a_pair_and_counted(qtbot: Any, view: Any, run_folder: Path) -> None:
    bar = view.preferences
    assert not bar.better["tuned"].isEnabled() and bar.train_note.text() == "load a run first"
    load(qtbot, view)
    assert bar.count_label.text() == f"0 preferences saved for {PreferenceStore.for_run(run_folder).label}"
    assert not bar.better["tuned"].isEnabled() and not bar.export_button.isEnabled()
    ask(qtbot, view, "say 3")
    tuned, base = (view.histories[side][-1]["content"] for side in ("tuned", "base"))
    assert tuned != base and bar.better["tuned"].isEnabled() and bar.better["base"].isEnabled()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    assert view.grab().save(str(SCREENSHOTS / "chat_preferences.png"))
    bar.better["tuned"].click()
    store = PreferenceStore.for_run(run_folder)
    (pair,) = store.pairs()
    assert pair.prompt == ({"role": "user", "content": "say 3"},) and (pair.chosen, pair.rejected) == (tuned, base)
    assert (pair.chosen_by, pair.rejected_by, pair.edited) == ("fine-tuned model", "base model", False)
    assert pair.run == view.registry.runs()[0].id
    assert bar.count_label.text() == f"1 preference saved for {store.label}"
    assert not bar.better["tuned"].isEnabled()  # one judgement per pair of answers
    assert bar.train_note.text() == "save at least 4 preferences first (3 more)" and not bar.train_button.isEnabled()
    assert view.histories["base"][-1]["content"] == tuned  # the chat goes on from the answer kept
    bar.undo_button.click()
    assert store.count() == 0 and bar.count_label.text().startswith("0 preferences")
    assert bar.better["base"].isEnabled() and not bar.undo_button.isEnabled()
    bar.better["base"].click()
    assert [(p.chosen, p.rejected) for p in store.pairs()] == [(base, tuned)]
    ask(qtbot, view, "say 4")  # the next turn: both sides answer the conversation that went on from the kept answer
    assert bar.better["tuned"].isEnabled()
    bar.better["tuned"].click()
    second = store.pairs()[-1]
    assert [m["content"] for m in second.prompt] == ["say 3", base, "say 4"]


def test_an_edited_answer_is_kept_over_the_one_it_was_made_from(qtbot: Any, view: Any, run_folder: Path) -> None:
    load(qtbot, view)
    ask(qtbot, view, "say 5")
    base = view.histories["base"][-1]["content"]
    bar = view.preferences
    bar.edit["base"].click()
    editor = bar.editor
    assert editor is not None and editor.isVisible() and editor.text() == base
    editor.save_button.click()  # unchanged: nothing to prefer
    assert PreferenceStore.for_run(run_folder).count() == 0 and "changed nothing" in bar.message.text()
    bar.edit["base"].click()
    bar.editor.editor.setPlainText("number 5")
    bar.editor.save_button.click()
    (pair,) = PreferenceStore.for_run(run_folder).pairs()
    assert (pair.chosen, pair.rejected, pair.edited) == ("number 5", base, True)
    assert (pair.chosen_by, pair.rejected_by) == ("your edit of base model", "base model")
    assert view.histories["tuned"][-1]["content"] == "number 5"


def test_two_answers_of_the_fine_tuned_model(qtbot: Any, view: Any) -> None:
    from engine.model.chat import GenerationSettings, reply

    load(qtbot, view)
    view.pairing.setCurrentIndex(view.pairing.findData("samples"))
    assert "answer 2" in view.pane_titles["base"].text()
    ask(qtbot, view, "say 6")  # greedy: both panes give the fine-tuned model's one answer
    tuned = reply(
        view.chat, [{"role": "user", "content": "say 6"}], GenerationSettings(temperature=0, max_new_tokens=12)
    )
    assert view.histories["tuned"][-1]["content"] == view.histories["base"][-1]["content"] == tuned
    assert "the same" in view.preferences.choice_note.text() and not view.preferences.better["tuned"].isEnabled()
    view.compare.setChecked(False)
    ask(qtbot, view, "say 7")
    assert not view.preferences.better["tuned"].isEnabled()  # one answer: nothing to compare


def test_export_writes_dpo_data_the_engine_reads(
    qtbot: Any, view: Any, run_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PySide6.QtWidgets import QFileDialog

    load(qtbot, view)
    ask(qtbot, view, "say 8")
    view.preferences.better["tuned"].click()
    target = tmp_path / "exported" / "mine.jsonl"
    asked: list[str] = []

    def save_name(parent: Any, caption: str, folder: str, filters: str) -> tuple[str, str]:
        asked.append(folder)
        return str(target), filters

    monkeypatch.setattr(QFileDialog, "getSaveFileName", staticmethod(save_name))
    assert view.preferences.export_button.isEnabled()
    view.preferences.export_button.click()
    assert asked and asked[0].endswith(".jsonl")
    (pair,), fmt = load_examples(target)
    assert fmt == "preference" and pair.chosen[0].content == view.histories["tuned"][-1]["content"]  # type: ignore[union-attr]
    assert "1 pairs written" in view.preferences.message.text()


def test_train_on_my_preferences_runs_dpo_from_the_runs_adapter(
    qtbot: Any,
    window: Any,
    run_folder: Path,
) -> None:
    from app.background.run_controller import FAILED, FINISHED

    Registry().upsert(run_folder, name="tiny chat run", status="finished", model="tiny-llama")
    chat = window.page("Chat")
    chat.device = "cpu"
    chat.refresh_runs()
    store = PreferenceStore.for_run(run_folder)
    for i in range(3):
        store.add([{"role": "user", "content": f"say {i}"}], f"number {i}", f"fox {i}", chosen_by="t", rejected_by="b")
    window.show_page("Chat")
    load(qtbot, chat)
    assert chat.preferences.count_label.text().startswith("3 preferences")
    assert "1 more" in chat.preferences.train_note.text() and not chat.preferences.train_button.isEnabled()
    ask(qtbot, chat, "say 9")
    chat.preferences.better["tuned"].click()
    assert chat.preferences.train_button.isEnabled() and chat.preferences.train_note.text() == ""
    chat.preferences.train_button.click()
    assert window.current_page() == "Run"
    assert chat.preferences.train_note.text() == "a run is going: wait for it to end"
    assert not chat.preferences.train_button.isEnabled()
    qtbot.waitUntil(lambda: window.controller.state in (FINISHED, FAILED), timeout=RUN_TIMEOUT_MS)
    assert window.controller.state == FINISHED, window.run_panel.error.text()
    config = window.controller.config
    best = run_folder / "adapter-best"
    assert config.training.method == "dpo" and config.model.adapter == str(
        best if best.is_dir() else run_folder / "adapter"
    )
    run_dir = Path(window.state.run.run_dir)
    saved = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    assert saved["training"]["method"] == "dpo" and saved["model"]["adapter"] == config.model.adapter
    assert len(Path(saved["data"]["path"]).read_text(encoding="utf-8").splitlines()) == 4
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()
    qtbot.waitUntil(lambda: chat.preferences.train_button.isEnabled(), timeout=TIMEOUT_MS)
