"""The app sends nothing to the model hub unless the user asks: choosing a gallery model reads only what is on disk
(its built-in shape, the tokenizer from the cache), says when the tokenizer is not on this computer, and fetches it
only when the user presses "Look up … on the hub"."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from app_demo import LOAD_TIMEOUT_MS, prepare_demo

from engine.errors import ModelLoadError
from engine.model import hub as model_hub
from engine.model import load

pytest_plugins = ["app_fixtures"]


@pytest.fixture
def requests_sent(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """An online machine with an empty Hugging Face cache whose every connection is recorded and refused."""
    import huggingface_hub.constants as hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    sent: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        sent.append(args[1:] if args and isinstance(args[0], socket.socket) else args)
        raise OSError("the test machine has no network")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return sent


def test_choosing_a_gallery_model_sends_nothing_until_asked(
    qtbot: Any, window: Any, requests_sent: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    prepare_demo(qtbot, window, max_steps=5)
    panel, data = window.model_panel, window.data_panel
    panel.gallery.select("Qwen/Qwen3-0.6B")
    panel.use.click()
    qtbot.waitUntil(lambda: window.state.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    qtbot.waitUntil(lambda: data.problem != "", timeout=LOAD_TIMEOUT_MS)  # the data re-read for the new model
    assert requests_sent == [], "choosing a model must not reach the network"
    assert "not on this computer" in data.problem
    assert data.fetch.isVisibleTo(data) and "Qwen/Qwen3-0.6B" in data.fetch.text()
    ready, text = data.step_status()
    assert not ready and "tokenizer of Qwen/Qwen3-0.6B" in text
    window.hardware_panel.detect()  # a new detection plans the model again, still from what is on disk
    qtbot.waitUntil(lambda: not window.tasks.busy(), timeout=LOAD_TIMEOUT_MS)
    assert requests_sent == []
    asked: list[str] = []

    def from_the_hub(config: Any) -> Any:  # what the engine would fetch, without waiting on the retries
        asked.append(config.name)
        raise ModelLoadError("cannot reach the hub", hint="check your network")

    monkeypatch.setattr(load, "load_tokenizer", from_the_hub)
    monkeypatch.setattr(model_hub, "reach_hub", lambda: None)  # the hub answers, and then the tokenizer fails
    data.fetch.click()  # the user asks: now, and only now, the hub is asked
    qtbot.waitUntil(lambda: data.problem != "", timeout=LOAD_TIMEOUT_MS)
    assert asked == ["Qwen/Qwen3-0.6B"]
    assert "cannot reach the hub" in data.problem and data.fetch.isVisibleTo(data), "said, and the button stays"


def test_the_dataset_page_shows_nothing_of_the_previous_model_under_the_error(
    qtbot: Any, window: Any, requests_sent: list[Any]
) -> None:
    prepare_demo(qtbot, window, max_steps=5)
    data = window.data_panel
    assert data.histogram.bars is not None and data.preview.toPlainText(), "the demo's report is shown"
    window.model_panel.gallery.select("Qwen/Qwen3-0.6B")
    window.model_panel.use.click()
    qtbot.waitUntil(lambda: data.problem != "", timeout=LOAD_TIMEOUT_MS)  # no tokenizer for the new model here
    assert data.histogram.bars is None and data.histogram.lengths == []
    assert data.preview.toPlainText() == "" and data.problems.count() == 0


def choose_qwen_without_its_tokenizer(qtbot: Any, window: Any) -> Any:
    """The demo set up, then a gallery model whose tokenizer is not on this computer: the Dataset page's error."""
    prepare_demo(qtbot, window, max_steps=5)
    window.model_panel.gallery.select("Qwen/Qwen3-0.6B")
    window.model_panel.use.click()
    qtbot.waitUntil(lambda: window.state.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    qtbot.waitUntil(lambda: window.data_panel.problem != "", timeout=LOAD_TIMEOUT_MS)
    return window.data_panel


def test_looking_up_a_tokenizer_without_a_network_fails_at_the_first_refusal(
    qtbot: Any, window: Any, requests_sent: list[Any]
) -> None:
    data = choose_qwen_without_its_tokenizer(qtbot, window)
    data.fetch.click()
    assert "Looking up Qwen/Qwen3-0.6B's tokenizer on the hub" in data.summary.text(), "not 'Reading train.jsonl'"
    qtbot.waitUntil(lambda: data.problem != "", timeout=LOAD_TIMEOUT_MS)
    assert len(requests_sent) == 1, f"one refused connection is the answer, not {len(requests_sent)} retries"
    assert "cannot reach the Hugging Face hub" in data.problem, data.problem
    assert data.fetch.isVisibleTo(data), "the button stays, to try again once the network is back"
    assert data.histogram.bars is None and data.preview.toPlainText() == ""
    ready, _ = window.model_panel.step_status()
    assert ready, "the model itself is fine: only its tokenizer is missing"


def test_the_model_page_says_what_is_missing_and_the_one_way_to_get_it(
    qtbot: Any, window: Any, requests_sent: list[Any]
) -> None:
    choose_qwen_without_its_tokenizer(qtbot, window)
    status = window.model_panel.status.text()
    assert "downloaded when the run starts" not in status, "Start is disabled: no run starts to download anything"
    assert "its tokenizer is not on this computer" in status, status
    assert "Look up Qwen/Qwen3-0.6B's tokenizer on the hub" in status, "the one action that fixes it, by its name"
    assert window.data_panel.fetch.text() == "Look up Qwen/Qwen3-0.6B's tokenizer on the hub"
    assert requests_sent == []


def test_offline_mode_says_a_missing_tokenizer_cannot_be_fetched(
    qtbot: Any, window: Any, requests_sent: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants as hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    data = choose_qwen_without_its_tokenizer(qtbot, window)
    status = window.model_panel.status.text()
    assert "offline mode is on" in status and "cannot be fetched" in status, status
    assert "downloaded when the run starts" not in status
    assert "offline mode is on" in data.problem and not data.fetch.isVisibleTo(data), "no button that cannot work"
    assert requests_sent == []
