"""The app on a run whose held-out loss fell and then rose: the Run page warns and names the best adapter, and the
export dialog and the Chat page take the best adapter unless the user picks the last."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_best_adapter
from app_fixtures import no_dangling_qthreads  # noqa: F401
from hang import HANG_MS
from safetensors.torch import load_file
from test_best_adapter import same_weights

from engine.events import EvalRising
from engine.run.registry import Registry

fitting_model = test_best_adapter.fitting_model  # the fixtures: a tiny model LoRA fits fast, and its overfit run
overfit = test_best_adapter.overfit
TIMEOUT_MS = HANG_MS


def test_the_run_page_warns_of_a_rising_held_out_loss_and_names_the_best_adapter(
    qtbot: Any, tmp_path: Path, overfit: tuple[list[Any], Path]
) -> None:
    from test_app_window import open_window

    events, _ = overfit
    panel = open_window(qtbot, tmp_path / "window.ini").run_panel
    for event in events:
        panel.on_event(event)
    rising = next(e for e in events if isinstance(e, EvalRising))
    messages = panel.warnings.messages()
    assert any(m.startswith(f"⚠ Step {rising.step}: the held-out loss has risen 3 evaluations") for m in messages)
    best = [m for m in messages if m.startswith("Best adapter so far")]
    assert best == [f"Best adapter so far: step {rising.best_step} (held-out loss {rising.best_eval_loss:.3f}), kept "
                    "for Chat/Export"]  # fmt: skip
    assert f"Best adapter: step {rising.best_step}" in panel.status.text()


def weights(folder: Path) -> Any:
    return load_file(folder / "adapter_model.safetensors")


def test_the_export_dialog_exports_the_best_adapter_unless_the_last_is_chosen(
    qtbot: Any, tmp_path: Path, overfit: tuple[list[Any], Path]
) -> None:
    from app.pages.export import ExportDialog

    _, run_dir = overfit
    dialog = ExportDialog(run_dir, "overfit")
    qtbot.addWidget(dialog)
    dialog.show()
    assert [dialog.adapter.itemData(i) for i in range(dialog.adapter.count())] == ["best", "last"]
    assert dialog.adapter.which() == "best" and "held-out loss" in dialog.adapter.currentText()
    for which in ("best", "last"):
        dialog.adapter.setCurrentIndex(dialog.adapter.findData(which))
        dialog.target.setText(str(tmp_path / which))
        dialog.export_button.click()
        qtbot.waitUntil(lambda: not dialog.busy() and dialog.export_button.isEnabled(), timeout=TIMEOUT_MS)
        assert dialog.error.text() == ""
        source = run_dir / ("adapter-best" if which == "best" else "adapter")
        assert same_weights(weights(tmp_path / which), weights(source))
    dialog.tasks.wait_all()


def test_the_chat_page_loads_the_best_adapter_unless_the_last_is_chosen(
    qtbot: Any, tmp_path: Path, overfit: tuple[list[Any], Path]
) -> None:
    from app.pages.chat import ChatView

    _, run_dir = overfit
    registry = Registry(tmp_path / "runs.db")
    registry.upsert(run_dir, name="overfit", status="finished", model="tiny-llama")
    view = ChatView(registry, device="cpu")
    qtbot.addWidget(view)
    view.show()
    try:
        assert view.adapter.which() == "best"
        for which in ("best", "last"):
            view.adapter.setCurrentIndex(view.adapter.findData(which))
            # the button a user clicks: enabled again only once the last load's end has reached the page (a click
            # while it is still disabled does nothing, and the wait below would never end)
            qtbot.waitUntil(view.load_button.isEnabled, timeout=TIMEOUT_MS)
            view.load_button.click()
            assert not view.load_button.isEnabled(), "the load did not start"
            qtbot.waitUntil(
                lambda: view.load_button.isEnabled() and (view.chat is not None or "error" in view.status.text()),
                timeout=TIMEOUT_MS,
            )
            assert view.chat is not None, view.status.text()
            assert view.chat.adapter.which == which
            assert view.chat.adapter.describe() in view.status.text()
            view.chat = None
    finally:
        view.close()


@pytest.mark.parametrize("has_best", [True, False])
def test_a_run_without_a_best_adapter_offers_only_the_last(
    qtbot: Any, tmp_path: Path, overfit: tuple[list[Any], Path], has_best: bool
) -> None:
    import shutil

    from app.widgets.adapter_choice import AdapterChoice

    _, run_dir = overfit
    folder = tmp_path / "run"
    shutil.copytree(run_dir / "adapter", folder / "adapter")
    if has_best:
        shutil.copytree(run_dir / "adapter-best", folder / "adapter-best")
    choice = AdapterChoice()
    qtbot.addWidget(choice)
    choice.show_run(folder)
    assert choice.count() == (2 if has_best else 1) and choice.isEnabled() == has_best
    assert choice.which() == ("best" if has_best else "last")
