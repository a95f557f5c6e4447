"""The chat page with a vision-language run: a picture chosen beside the prompt, tuned and base answers about it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from app_fixtures import no_dangling_qthreads  # noqa: F401
from hang import HANG_MS
from test_vision_train import colour_rows, config
from vision_models import build_vision_model

from engine.events import RunFinished
from engine.run.registry import Registry
from engine.train import run


@pytest.fixture(scope="module")
def image_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("image-chat")
    model = build_vision_model(folder / "model", "idefics3")
    events = list(run(config(model, colour_rows(folder), folder / "runs", max_steps=2)))
    (finished,) = [e for e in events if isinstance(e, RunFinished)]
    return Path(finished.run_dir)


def test_a_picture_question_gets_the_tuned_and_the_base_answer(qtbot: Any, image_run: Path, tmp_path: Path) -> None:
    from app.pages.chat import ChatView
    from engine.vision.chat import ask

    registry = Registry(tmp_path / "runs.db")
    registry.upsert(image_run, name="pictures", status="finished", model="tiny-idefics3")
    view = ChatView(registry, device="cpu")
    qtbot.addWidget(view)
    view.show()
    assert view.picture.isHidden()
    view.load_button.click()
    qtbot.waitUntil(lambda: view.chat is not None and view.send_button.isEnabled(), timeout=HANG_MS)
    assert not view.picture.isHidden()  # a vision-language run: questions can show a picture
    picture = str(image_run.parent.parent / "red.png")
    view.picture.set_path(picture)
    view.max_tokens.setValue(6)
    view.prompt.setText("colour?")
    view.send_button.click()
    qtbot.waitUntil(lambda: not view.worker.isRunning() and view.send_button.isEnabled(), timeout=HANG_MS)
    assert "(about red.png)" in view.panes["tuned"].toPlainText()
    tuned = ask(view.chat, "colour?", picture, True, 6)
    base = ask(view.chat, "colour?", picture, False, 6)
    assert view.histories["tuned"][-1]["content"] == tuned
    assert view.histories["base"][-1]["content"] == base
    view.close()
