"""The Model page's GGUF models on this computer: an Ollama store listed with size, quantization and family, a model
converted on choosing it (what was dequantized from what, then the planner's verdict), and a family transformers
cannot read refused with the families it can."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hang import HANG_MS
from ollama_store import add_to_ollama_store
from test_export_gguf import make_run

from engine.config import demo_model_dir

pytest_plugins = ["app_fixtures"]

LOAD_TIMEOUT_MS = HANG_MS


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model with a random adapter merged, as a q8_0 GGUF file (TuneDeck's own export)."""
    from engine.export import export_gguf

    root = tmp_path_factory.mktemp("demo-gguf")
    return export_gguf(make_run(demo_model_dir(), root), root / "export", quant="q8_0") / "tiny-run.gguf"


def vision_gguf(path: Path) -> Path:
    """A GGUF of a family transformers does not read as a language model (a vision projector)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_tensor("v.patch_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def store(demo_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    store = tmp_path / "ollama"
    add_to_ollama_store(store, demo_gguf, "tiny", "latest")
    add_to_ollama_store(store, vision_gguf(tmp_path / "vision.gguf"), "projector", "v1")
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no LM Studio folder
    return store


def listed(window: Any, qtbot: Any) -> Any:
    panel = window.model_panel
    panel.on_disk.setChecked(True)
    qtbot.waitUntil(lambda: panel.local.table.rowCount() == 2, timeout=LOAD_TIMEOUT_MS)
    return panel


def test_ollama_models_are_listed_with_size_quantization_and_family(window: Any, qtbot: Any, store: Path) -> None:
    panel = listed(window, qtbot)
    table = panel.local.table
    rows = [[table.item(r, c).text() for c in range(table.columnCount())] for r in range(table.rowCount())]
    assert rows[0][:2] == ["ollama:projector:v1", "Ollama"] and "transformers cannot read it" in rows[0][4]
    name, origin, size, quant, family, _ = rows[1]
    assert (name, origin, quant, family) == ("ollama:tiny:latest", "Ollama", "Q8_0", "llama")
    assert size.endswith(("KB", "MB"))
    assert "2 GGUF models" in panel.local.note.text()


def test_choosing_one_converts_it_and_says_from_what(window: Any, qtbot: Any, store: Path) -> None:
    panel = listed(window, qtbot)
    panel.local.table.selectRow(1)
    assert panel.selected_name() == "ollama:tiny:latest"
    panel.use.click()
    qtbot.waitUntil(lambda: panel.state.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    assert panel.state.model_name == "ollama:tiny:latest" and panel.problem == ""
    assert "Q8_0 → float32" in panel.details.toPlainText()
    assert panel.step_status()[0]


def test_a_family_transformers_cannot_read_is_refused_with_those_it_can(window: Any, qtbot: Any, store: Path) -> None:
    panel = listed(window, qtbot)
    panel.local.table.cellDoubleClicked.emit(0, 0)  # as a double-click on the first row does
    qtbot.waitUntil(lambda: bool(panel.problem), timeout=LOAD_TIMEOUT_MS)
    assert "transformers cannot read" in panel.problem
    assert "llama" in panel.details.toPlainText() and not panel.step_status()[0]


def test_one_model_is_counted_as_one(
    window: Any, qtbot: Any, demo_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "ollama"
    add_to_ollama_store(store, demo_gguf, "tiny", "latest")
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no LM Studio folder
    panel = window.model_panel
    panel.on_disk.setChecked(True)
    qtbot.waitUntil(lambda: panel.local.table.rowCount() == 1, timeout=LOAD_TIMEOUT_MS)
    assert panel.local.note.text().startswith("1 GGUF model on this computer"), panel.local.note.text()
