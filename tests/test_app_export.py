"""The export dialog offscreen: the adapter and the merged model through the real engine on a tiny finished run,
a clear error for a folder in use, Open folder, and GGUF through a stand-in for ``engine.export.export_gguf``."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import test_export_install
from hang import HANG_MS
from PySide6.QtCore import Qt
from test_chat import train_tiny_run
from test_export_install import OLLAMA_ANSWER, closed_port

import engine.export
from engine.run.registry import Registry

pytest_plugins = ["app_fixtures"]  # the dangling-QThread guard
runtime = test_export_install.runtime  # the fixture: a stand-in Ollama / LM Studio server
TIMEOUT_MS = HANG_MS


@pytest.fixture(scope="module")
def run_folder(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_run(tiny_model_dir, tmp_path_factory.mktemp("app-export"))


@pytest.fixture
def dialog(qtbot: Any, run_folder: Path) -> Any:
    from app.pages.export import ExportDialog

    widget = ExportDialog(run_folder, "tiny run")
    qtbot.addWidget(widget)
    widget.show()
    yield widget
    widget.tasks.wait_all()


def export(qtbot: Any, dialog: Any, kind: str, target: Path) -> None:
    dialog.kinds[kind].setChecked(True)
    dialog.target.setText(str(target))
    dialog.export_button.click()
    assert not dialog.close_button.isEnabled(), "an export cannot be closed half-way"
    qtbot.waitUntil(lambda: not dialog.busy() and dialog.export_button.isEnabled(), timeout=TIMEOUT_MS)


def test_the_adapter_exports_and_its_folder_opens(
    qtbot: Any, dialog: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[str] = []
    monkeypatch.setattr("app.pages.export.QDesktopServices.openUrl", lambda url: opened.append(url.toLocalFile()))
    assert dialog.target.text() == str(dialog.run_folder / "exports" / "adapter")
    assert not dialog.open_button.isEnabled()
    export(qtbot, dialog, "adapter", tmp_path / "my adapter")
    target = tmp_path / "my adapter"
    assert dialog.error.text() == ""
    assert dialog.result == target and (target / "adapter_model.safetensors").exists()
    assert "PeftModel.from_pretrained" in (target / "README.md").read_text()
    assert f"Exported to {target}" in dialog.status.text()
    dialog.open_button.click()
    assert opened == [str(target)]


def test_the_merged_model_exports_in_the_chosen_dtype(qtbot: Any, dialog: Any, tmp_path: Path) -> None:
    dialog.kinds["merged"].setChecked(True)
    assert dialog.dtype.isEnabled() and not dialog.quant.isEnabled()
    assert dialog.dtype.currentText() == "float32", "offered in the dtype the run computed in (float32 on the CPU)"
    dialog.dtype.setCurrentText("float16")
    assert dialog.target.text().endswith("merged-float16")
    export(qtbot, dialog, "merged", tmp_path / "merged")
    assert dialog.error.text() == "", dialog.error.text()
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["dtype" if "dtype" in config else "torch_dtype"] == "float16"
    assert (tmp_path / "merged" / "model.safetensors").exists()
    assert not (tmp_path / "merged" / "adapter_config.json").exists(), "merged: no peft needed"


def test_a_folder_in_use_is_refused_clearly_until_replacing_is_ticked(qtbot: Any, dialog: Any, tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    export(qtbot, dialog, "adapter", target)
    assert "exists and is not empty" in dialog.error.text()
    assert "Replace what is already in that folder" in dialog.error.text()
    assert (target / "notes.txt").read_text() == "mine" and dialog.result is None
    assert not dialog.open_button.isEnabled()
    dialog.overwrite.setChecked(True)
    export(qtbot, dialog, "adapter", target)
    assert dialog.error.text() == "" and (target / "adapter_config.json").exists()


def test_a_run_without_an_adapter_fails_with_what_to_do(qtbot: Any, tmp_path: Path) -> None:
    from app.pages.export import ExportDialog

    empty = tmp_path / "unfinished run"
    empty.mkdir()
    dialog = ExportDialog(empty)
    qtbot.addWidget(dialog)
    export(qtbot, dialog, "adapter", tmp_path / "out")
    assert "no finished adapter" in dialog.error.text() and "What to do: " in dialog.error.text()
    assert not (tmp_path / "out").exists()


def test_gguf_is_offered_only_when_the_engine_has_it(dialog: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.pages.export import gguf_quants

    if hasattr(engine.export, "export_gguf"):
        monkeypatch.delattr(engine.export, "export_gguf")
    assert gguf_quants() == ()
    from app.pages.export import ExportDialog

    without = ExportDialog(dialog.run_folder)
    assert not without.kinds["gguf"].isEnabled()
    assert "not part of this TuneDeck" in without.kinds["gguf"].toolTip()
    without.deleteLater()


@dataclass(frozen=True)
class FakeProgress:
    stage: str
    done: int
    total: int
    message: str = ""


def test_gguf_exports_with_the_chosen_quant_and_reports_progress(
    qtbot: Any, run_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.pages.export import ExportDialog

    calls: list[dict[str, Any]] = []

    def fake_export_gguf(run: Any, target: Any, *, quant: str = "q8_0", overwrite: bool = False,
                         on_progress: Any = None, adapter: str = "best") -> Path:  # fmt: skip
        calls.append({"run": Path(run), "target": Path(target), "quant": quant, "overwrite": overwrite,
                      "adapter": adapter})  # fmt: skip
        for done in range(4):
            on_progress(FakeProgress("tensors", done, 3, f"writing tensor {done} of 3"))
        Path(target).mkdir(parents=True)
        (Path(target) / f"model-{quant}.gguf").write_bytes(b"GGUF")
        (Path(target) / "Modelfile").write_text(f"FROM ./model-{quant}.gguf\n")
        return Path(target) / f"model-{quant}.gguf"

    monkeypatch.setattr(engine.export, "export_gguf", fake_export_gguf, raising=False)
    monkeypatch.setattr(engine.export, "GGUF_QUANTS", ("f16", "q8_0", "q4_k_m"), raising=False)
    dialog = ExportDialog(run_folder)
    qtbot.addWidget(dialog)
    seen: list[int] = []
    dialog.progress.valueChanged.connect(seen.append)
    assert dialog.kinds["gguf"].isEnabled() and dialog.quant.currentText() == "q8_0"
    dialog.kinds["gguf"].setChecked(True)
    dialog.quant.setCurrentText("q4_k_m")
    assert dialog.target.text().endswith("gguf-q4_k_m")
    export(qtbot, dialog, "gguf", tmp_path / "gguf")
    assert calls == [
        {"run": run_folder, "target": tmp_path / "gguf", "quant": "q4_k_m", "overwrite": False, "adapter": "best"}
    ]
    assert dialog.result == tmp_path / "gguf" / "model-q4_k_m.gguf"
    assert dialog.export_folder() == tmp_path / "gguf"
    assert 1000 in seen, "the last tensor filled the bar"
    assert f"ollama create {run_folder.name.lower()} -f {tmp_path / 'gguf' / 'Modelfile'}" in dialog.status.text()
    assert dialog.error.text() == ""


def test_the_runs_page_exports_the_selected_run(qtbot: Any, run_folder: Path, tmp_path: Path) -> None:
    from app.pages.runs import RunsView

    registry = Registry(tmp_path / "runs.db")
    registry.upsert(run_folder, name="tiny run", status="finished", model="tiny-llama")
    view = RunsView(registry)
    qtbot.addWidget(view)
    assert not view.export_button.isEnabled(), "nothing selected"
    view.select_runs([record.id for record in view.records])
    assert view.export_button.isEnabled()
    dialog = view.export_selected()
    assert dialog is not None and dialog.run_folder == Path(view.records[0].folder)
    assert "tiny run" in dialog.windowTitle()
    dialog.reject()


def test_gguf_through_the_engine_writes_the_file_and_its_modelfile(
    qtbot: Any, dialog: Any, run_folder: Path, tmp_path: Path
) -> None:
    if not callable(getattr(engine.export, "export_gguf", None)):
        pytest.skip("this engine has no GGUF export")
    assert dialog.kinds["gguf"].isEnabled()
    dialog.kinds["gguf"].setChecked(True)
    dialog.quant.setCurrentText("q8_0")
    export(qtbot, dialog, "gguf", tmp_path / "gguf")
    assert dialog.error.text() == "", dialog.error.text()
    assert list((tmp_path / "gguf").glob("*.gguf")) and (tmp_path / "gguf" / "Modelfile").exists()
    assert "ollama create" in dialog.status.text()


def test_a_missing_package_is_named_with_how_to_install_it() -> None:
    from app.background.worker import describe_error

    info = describe_error(ModuleNotFoundError("No module named 'gguf.constants'", name="gguf.constants"))
    assert info.message == "a package TuneDeck needs is not installed: gguf" and "pip install gguf" in info.hint


def test_install_buttons_put_the_gguf_export_into_ollama_and_lm_studio(
    qtbot: Any, dialog: Any, run_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    runtime: tuple[str, dict[str, Any]],
) -> None:  # fmt: skip
    """After a real GGUF export, "Install in Ollama" (a stand-in Ollama server) shows its answer beside TuneDeck's;
    "Install in LM Studio" with no LM Studio server running says what was done and what to do."""
    from engine.export.install import DEFAULT_QUESTION, LMSTUDIO_URL_VARIABLE, held_out_question, tunedeck_answer

    if not callable(getattr(engine.export, "export_gguf", None)):
        pytest.skip("this engine has no GGUF export")
    address, state = runtime
    bin_folder = tmp_path / "bin"
    bin_folder.mkdir()
    monkeypatch.setenv("PATH", str(bin_folder))  # no ollama command: the API is used
    monkeypatch.setenv("OLLAMA_HOST", address)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home" / ".lmstudio").mkdir(parents=True)  # LM Studio is installed, its server not started
    monkeypatch.setenv(LMSTUDIO_URL_VARIABLE, f"http://{closed_port()}")
    panel = dialog.install
    assert not panel.buttons["ollama"].isEnabled(), "nothing to install before a GGUF export"
    dialog.kinds["gguf"].setChecked(True)
    dialog.quant.setCurrentText("q8_0")
    export(qtbot, dialog, "gguf", tmp_path / "gguf")
    assert "Tensor types: q8_0 requested: " in dialog.status.text()
    assert panel.buttons["ollama"].isEnabled() and panel.buttons["lmstudio"].isEnabled()
    asked = held_out_question(run_folder) or DEFAULT_QUESTION  # one the run held out, read in the background
    qtbot.waitUntil(lambda: panel.question.text() == asked, timeout=TIMEOUT_MS)

    state["hold"] = threading.Event()
    qtbot.mouseClick(panel.buttons["ollama"], Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: any(path == "/api/chat" for _, path, _ in state["calls"]), timeout=TIMEOUT_MS)
    assert not panel.buttons["lmstudio"].isEnabled(), "one install at a time"
    dialog.export_button.click()  # a new export would replace the file being installed
    assert "an install is still running" in dialog.error.text() and not dialog.tasks.busy()
    state["hold"].set()
    qtbot.waitUntil(lambda: not panel.busy() and panel.report is not None, timeout=TIMEOUT_MS)
    assert ("POST", "/api/create") in [(method, path) for method, path, _ in state["calls"]]
    assert panel.runtime_label.text() == "<b>Ollama's answer</b>" and panel.runtime_answer.text() == OLLAMA_ANSWER
    assert panel.tunedeck_answer.text() == tunedeck_answer(run_folder, panel.question.text())
    assert panel.tunedeck_answer.text() and panel.tunedeck_answer.isVisible()
    assert "created the model run through Ollama's API" in panel.status.text()

    qtbot.mouseClick(panel.buttons["lmstudio"], Qt.MouseButton.LeftButton)
    qtbot.waitUntil(
        lambda: not panel.busy() and getattr(panel.report, "runtime", "") == "LM Studio", timeout=TIMEOUT_MS
    )
    placed = tmp_path / "home" / ".lmstudio" / "models" / "tunedeck" / "run" / "run.gguf"
    assert placed.read_bytes() == (tmp_path / "gguf" / "run.gguf").read_bytes()
    assert "does not answer" in panel.status.text() and "lms load tunedeck/run" in panel.status.text()
    assert not panel.runtime_answer.isVisible() and not panel.tunedeck_answer.isVisible()
    assert panel.buttons["ollama"].isEnabled(), "ready for another install"
