"""The runs page offscreen: the table from the registry, overlaid loss curves, resume, rename and delete."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from app_fixtures import no_dangling_qthreads  # noqa: F401
from helpers import write_jsonl

from engine.config import RunConfig
from engine.events import StepMetrics
from engine.run.recorder import recorded
from engine.run.registry import Registry
from engine.train import run

SCREENSHOTS = Path(__file__).resolve().parents[1] / "artifacts" / "screenshots"


def tiny_run(model_dir: Path, data: Path, out: Path, name: str, lr: float, stop_after: int | None = None) -> None:
    config = RunConfig.from_dict(
        {
            "model": {"name": str(model_dir)},
            "data": {"path": str(data), "max_seq_len": 64, "tokens_per_batch": 128, "eval_fraction": 0.15},
            "training": {"max_steps": 6, "learning_rate": lr, "warmup_steps": 1, "save_every": 2, "eval_every": 2},
            "output": {"dir": str(out), "name": name},
        }
    )
    events = recorded(run(config), Registry(), name=name)
    for event in events:
        if stop_after is not None and isinstance(event, StepMetrics) and event.step == stop_after:
            break
    events.close()


@pytest.fixture(scope="module")
def registry(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Registry:
    """Three recorded runs of the tiny model: two finished with different learning rates, one interrupted."""
    root = tmp_path_factory.mktemp("runs-view")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TUNEDECK_HOME", str(root / "home"))
        rows = [
            {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"number {i}"}]}
            for i in range(24)
        ]
        data = write_jsonl(root / "chat.jsonl", rows)
        tiny_run(tiny_model_dir, data, root / "runs", "fast lr", 5e-3)
        tiny_run(tiny_model_dir, data, root / "runs", "slow lr", 5e-4)
        tiny_run(tiny_model_dir, data, root / "runs", "cut short", 2e-3, stop_after=3)
        return Registry()


@pytest.fixture
def view(qtbot: Any, registry: Registry) -> Any:
    from app.pages.runs import RunsView

    widget = RunsView(registry)
    widget.resize(1100, 750)
    qtbot.addWidget(widget)
    widget.show()
    return widget


def cell(view: Any, row: int, column: str) -> str:
    from app.pages.runs import COLUMNS

    return view.table.item(row, COLUMNS.index(column)).text()


def test_table_shows_every_run_with_its_summary(view: Any, registry: Registry) -> None:
    records = registry.runs()
    assert view.table.rowCount() == 3
    names = [cell(view, row, "Name") for row in range(3)]
    assert names == [r.name for r in records] == ["cut short", "slow lr", "fast lr"]
    fast = names.index("fast lr")
    assert cell(view, fast, "Steps") == "6/6"
    assert cell(view, fast, "Status") == "finished"
    assert cell(view, fast, "Final loss") == f"{records[fast].final_loss:.4f}"
    assert cell(view, fast, "Dataset") == "chat.jsonl"
    assert cell(view, names.index("cut short"), "Status") == "interrupted (resumable)"


def test_selected_runs_overlay_train_and_eval_curves(view: Any, registry: Registry) -> None:
    from app.pages.runs import read_curves

    finished = [r for r in registry.runs() if r.status == "finished"]
    view.select_runs([r.id for r in finished])
    items = view.chart.getPlotItem().listDataItems()
    assert sorted(item.name() for item in items) == ["fast lr eval", "fast lr train", "slow lr eval", "slow lr train"]
    for record in finished:
        curves = read_curves(record.folder)
        assert curves.steps == [1, 2, 3, 4, 5, 6]
        assert curves.eval_steps == [2, 4, 6]
        train = next(item for item in items if item.name() == f"{record.name} train")
        assert list(train.getData()[1]) == pytest.approx(curves.losses)
    colours = {item.opts["pen"].color().name() for item in items if item.name().endswith("train")}
    assert len(colours) == 2
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    assert view.grab().save(str(SCREENSHOTS / "runs_view.png"))


def test_resume_emits_the_interrupted_run_folder(view: Any, qtbot: Any, registry: Registry) -> None:
    interrupted = next(r for r in registry.runs() if r.name == "cut short")
    view.select_runs([interrupted.id])
    assert view.resume_button.isEnabled()
    with qtbot.waitSignal(view.resume_requested) as signal:
        view.resume_button.click()
    assert signal.args == [interrupted.folder]
    finished = next(r for r in registry.runs() if r.name == "fast lr")
    view.select_runs([finished.id])
    assert not view.resume_button.isEnabled()


def test_rename_and_delete_with_confirmation(qtbot: Any, tmp_path: Path) -> None:
    from app.pages.runs import RunsView

    registry = Registry(tmp_path / "runs.db")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    write_jsonl(folder / "metrics.jsonl", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}])
    run_id = registry.upsert(folder, name="old", status="finished", steps=2)
    view = RunsView(registry)
    qtbot.addWidget(view)
    view.select_runs([run_id])
    view.rename_selected("new name")
    assert registry.get(run_id).name == "new name"
    assert cell(view, 0, "Name") == "new name"
    view.confirm_delete = lambda record: False
    view.delete_selected()
    assert folder.exists() and len(registry.runs()) == 1
    view.select_runs([run_id])
    view.confirm_delete = lambda record: record.id == run_id
    view.delete_selected()
    assert not folder.exists() and registry.runs() == []
    assert view.table.rowCount() == 0
    assert view.chart.getPlotItem().listDataItems() == []
