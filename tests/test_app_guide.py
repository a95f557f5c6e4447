"""The guided path's pieces without a run: the recipe page, the plain-words form, the gallery and the guide bar."""

from __future__ import annotations

from typing import Any

from app_demo import LOAD_TIMEOUT_MS
from hang import HANG_S

pytest_plugins = ["app_fixtures"]


def test_the_form_speaks_plain_words_in_one_label_column(qtbot: Any) -> None:
    from app.widgets.config_form import MAIN_FIELDS, ConfigForm

    form = ConfigForm(frozenset({"model.name", "data.path"}))
    qtbot.addWidget(form)
    form.show()
    labels = {key: label.text() for key, label in form.labels.items()}
    assert labels["data.overlong"] == "Examples longer than that"
    assert labels["data.eval_fraction"] == "Held-out share"
    assert "can run code" in form.editor("model.allow_pickle_weights").text()
    assert "unpickling can run code" in form.editor("model.allow_pickle_weights").toolTip()  # engine.config's help
    assert all("_" not in text for text in labels.values()), "no raw field names"
    widths = {label.width() for label in form.labels.values() if label.isVisible()}
    assert len(widths) == 1, f"label columns differ between groups: {widths}"
    assert all(not group.isVisible() for group in form.advanced_groups), "advanced settings start hidden"
    assert [key for key in form.labels if form.labels[key].isVisible()] == list(MAIN_FIELDS)
    form.advanced_button.click()
    assert all(group.isVisible() for group in form.advanced_groups)
    form.advanced_button.click()
    assert not form.advanced_groups[0].isVisible()


def test_each_recipe_shows_the_planners_memory_and_time_on_this_card(qtbot: Any) -> None:
    from app.app_state import AppState
    from app.pages.recipe import SetupPanel
    from engine.hardware import gpus
    from engine.hardware.profile import DeviceTarget
    from engine.hardware.shapes import load_shape
    from engine.model.info import ModelInfo

    state = AppState()
    panel = SetupPanel(state)
    qtbot.addWidget(panel)
    state.hardware = DeviceTarget.from_spec(gpus.find_gpu("RTX 4090"))
    state.set_model("Qwen/Qwen3-1.7B", ModelInfo("Qwen/Qwen3-1.7B", "qwen3", 1_700_000_000, False, "fits", "",
                                                 shape=load_shape("qwen3-1.7b")))  # fmt: skip
    assert panel.recipe_name() == "Automatic", "the demo's recipe is for the demo model only"
    assert panel.buttons["Demo"].isHidden()
    texts = {name: label.text() for name, label in panel.estimates.items() if not label.isHidden()}
    assert set(texts) == {"Automatic", "Quick test", "Balanced", "Long context", "Best quality"}
    assert all(" GiB · " in text for text in texts.values()), texts
    assert "30 steps · about" in texts["Quick test"]
    assert panel.step_status() == (True, "Automatic recipe")
    state.hardware = DeviceTarget.from_spec(gpus.find_gpu("RTX 3050 laptop"))  # 4 GiB
    panel.choose_recipe("Long context")
    assert not panel.step_status()[0] and "will not fit" in panel.step_status()[1]
    assert "does not fit" in panel.estimates["Long context"].text()


def test_the_gallery_plans_for_a_card_picked_from_the_table(qtbot: Any) -> None:
    from app.background.worker import TaskRunner
    from app.widgets.model_gallery import COLUMNS, VERDICT_TEXT, ModelGallery
    from engine.hardware import gpus
    from engine.hardware.gallery import gallery_rows
    from engine.hardware.profile import DeviceTarget

    tasks = TaskRunner()
    gallery = ModelGallery(tasks)
    qtbot.addWidget(gallery)
    gallery.card.setCurrentIndex(gallery.card.findData("RTX 4060 Laptop"))
    qtbot.waitUntil(lambda: bool(gallery.rows) and "RTX 4060 Laptop" in gallery.note.text(), timeout=LOAD_TIMEOUT_MS)
    expected = gallery_rows(DeviceTarget.from_spec(gpus.find_gpu("RTX 4060 Laptop")))
    column = COLUMNS.index("Trains with")
    shown = [gallery.table.item(i, column).text() for i in range(gallery.table.rowCount())]
    assert shown == [VERDICT_TEXT[row.verdict] for row in expected]
    assert gallery.selected_hub_id() == "demo", "the demo is selected to start with"
    tasks.wait_all()


def test_the_guide_names_what_is_missing(qtbot: Any, window: Any) -> None:
    guide = window.guide
    assert not guide.start_button.isEnabled()
    assert guide.buttons[0].toolTip() == "Choose a model (the demo is ready to try)"
    assert "Choose a dataset (the demo model brings its own)" in guide.buttons[1].toolTip()
    assert guide.next.text().startswith("Next: Choose a model")
    guide.buttons[2].click()
    assert window.pages.currentWidget().panel is window.setup_panel


def test_the_demo_runs_to_the_end_in_three_clicks(qtbot: Any, window: Any) -> None:
    from pathlib import Path

    from app.background import run_controller as rc
    from engine.events import RunFinished

    finished: list[RunFinished] = []
    window.controller.run_event.connect(lambda e: finished.append(e) if isinstance(e, RunFinished) else None)
    window.hardware_panel.detect()  # what the window does by itself once it is shown
    qtbot.waitUntil(lambda: window.state.hardware is not None, timeout=LOAD_TIMEOUT_MS)
    guide = window.guide
    qtbot.waitUntil(guide.start_button.isEnabled, timeout=LOAD_TIMEOUT_MS)  # the demo is ready with no click at all
    assert window.setup_panel.recipe_name() == "Demo" and window.data_panel.auto_demo

    guide.buttons[0].click()  # 1: the Model step
    assert window.pages.currentWidget().panel is window.model_panel
    assert window.model_panel.selected_name() == "demo"
    window.model_panel.use.click()  # 2: use the demo (its dataset and recipe follow)
    qtbot.waitUntil(guide.start_button.isEnabled, timeout=LOAD_TIMEOUT_MS)
    assert window.state.data_path.endswith("train.jsonl") and window.data_panel.auto_demo
    assert window.setup_panel.recipe_name() == "Demo"
    assert guide.next.text().startswith("Ready")
    window.setup_panel.form.editor("training.max_steps").setValue(4)  # keep the test short, not a user's click
    window.setup_panel.form.editor("training.save_every").setValue(0)
    guide.start_button.click()  # 3: start
    qtbot.waitUntil(lambda: window.controller.state == rc.RUNNING, timeout=LOAD_TIMEOUT_MS)
    assert window.pages.currentWidget().panel is window.run_panel
    assert not guide.start_button.isEnabled() and guide.next.toolTip().endswith("; watch it on the Run page.")
    qtbot.waitUntil(lambda: window.controller.state == rc.FINISHED, timeout=LOAD_TIMEOUT_MS)
    assert finished and not finished[-1].cancelled and finished[-1].step == 4
    assert Path(finished[-1].adapter_dir, "adapter_config.json").exists()
    qtbot.waitUntil(lambda: not window.controller.worker.isRunning(), timeout=LOAD_TIMEOUT_MS)
    # ready for the next run, once the worker's end has reached the page (a queued signal, after the thread stops)
    qtbot.waitUntil(guide.start_button.isEnabled, timeout=LOAD_TIMEOUT_MS)


def test_only_the_latest_dataset_load_reports(qtbot: Any, window: Any, tmp_path: Any) -> None:
    from PySide6.QtWidgets import QApplication

    from app.pages.data import demo_data_file

    (tmp_path / "broken.jsonl").write_text("{not json\n", encoding="utf-8")
    panel = window.data_panel
    panel.load(str(tmp_path / "broken.jsonl"))
    panel.load(str(demo_data_file()))
    qtbot.waitUntil(lambda: window.state.data_report is not None, timeout=LOAD_TIMEOUT_MS)
    qtbot.waitUntil(lambda: not window.tasks.busy(), timeout=LOAD_TIMEOUT_MS)  # both loads ended ...
    QApplication.processEvents()  # ... and what they posted to the window has arrived
    assert panel.problem == "" and panel.step_status()[0], panel.step_status()
    assert window.state.data_path == str(demo_data_file())


def test_two_datasets_read_at_once_on_a_fresh_start(tmp_path: Any) -> None:
    """The first import of transformers' tokenizers from two threads at once must not fail."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import threading\n"
        "from engine.run.data_report import analyze_dataset\n"
        "from app.pages.data import demo_data_file\n"
        "errors = []\n"
        "def read():\n"
        "    try:\n"
        "        analyze_dataset(str(demo_data_file()), 'demo')\n"
        "    except Exception as err:\n"
        "        errors.append(repr(err))\n"
        "threads = [threading.Thread(target=read) for _ in range(2)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "assert not errors, errors\n"
    )
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "TUNEDECK_HOME": str(tmp_path)}
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S, cwd=root,
                            env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_gallery_model_is_planned_offline_and_what_is_missing_said(
    qtbot: Any, window: Any, monkeypatch: Any, tmp_path: Any
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never the network in tests
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    window.hardware_panel.detect()
    qtbot.waitUntil(lambda: window.state.hardware is not None, timeout=LOAD_TIMEOUT_MS)
    panel = window.model_panel
    qtbot.waitUntil(lambda: panel.gallery.row_for("Qwen/Qwen3-0.6B") is not None, timeout=LOAD_TIMEOUT_MS)
    qtbot.waitUntil(lambda: window.state.data_report is not None, timeout=LOAD_TIMEOUT_MS)  # the demo's data
    panel.gallery.select("Qwen/Qwen3-0.6B")
    assert panel.from_gallery.isChecked() and panel.selected_name() == "Qwen/Qwen3-0.6B"
    panel.use.click()
    qtbot.waitUntil(lambda: window.state.model_info is not None, timeout=LOAD_TIMEOUT_MS)
    info = window.state.model_info
    assert info.name == "Qwen/Qwen3-0.6B" and info.family == "qwen3"  # the built-in shape: nothing downloaded
    # offline, with no tokenizer on this computer, the page says what is missing, not that a run would download it
    qtbot.waitUntil(lambda: "its tokenizer is not on this computer and offline mode is on" in panel.status.text(),
                    timeout=LOAD_TIMEOUT_MS)  # fmt: skip
    assert "downloaded from the Hugging Face hub when the run starts" not in panel.status.text()
    assert window.setup_panel.recipe_name() == "Automatic", "the demo's recipe is for the demo model only"
    # the dataset is re-read with the model's tokenizer, which is not cached: the data step says so
    qtbot.waitUntil(lambda: window.data_panel.problem != "", timeout=LOAD_TIMEOUT_MS)
    ready, text = window.data_panel.step_status()
    assert not ready and text.startswith("Waiting for the model: cannot read the dataset without the tokenizer of")
    assert not window.guide.start_button.isEnabled()
