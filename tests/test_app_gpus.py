"""Several GPUs in the app: the GPU selector, its DDP/FSDP2 advice, and one memory/load lane per card."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hang import HANG_MS

from engine.hardware.detect import GpuInfo

pytest_plugins = ["app_fixtures"]
GIB = 1 << 30


def machine(*memories_gib: int) -> Any:
    cards = tuple(
        GpuInfo(i, "NVIDIA GeForce RTX 3090", (8, 6), gib * GIB, usable_by_torch=True)
        for i, gib in enumerate(memories_gib)
    )
    return SimpleNamespace(gpus=cards)  # the selector reads only the cards


def test_gpu_selector_offers_every_card_and_sets_the_run(qtbot: Any) -> None:
    from app.widgets.gpu_selector import GpuSelector
    from engine.config import RunConfig

    selector = GpuSelector()
    qtbot.addWidget(selector)
    selector.set_hardware(machine(24, 24))
    assert selector.selected() == [0, 1]
    config = RunConfig.from_dict({"model": {"name": "llama-3.2-1b"}})
    assert selector.apply(config).training.gpus == "0,1"
    selector.show_plan(config)
    assert selector.plan.text().startswith("2 GPUs, one process each: DDP")
    selector.boxes[1].setChecked(False)
    assert selector.apply(config).training.gpus == "1"  # one card: the normal single-process run
    selector.show_plan(config)
    assert selector.plan.text() == "One GPU: a normal run."


def test_gpu_selector_advises_fsdp_when_the_model_does_not_fit_one_card(qtbot: Any) -> None:
    from app.widgets.gpu_selector import GpuSelector
    from engine.config import RunConfig

    selector = GpuSelector()
    qtbot.addWidget(selector)
    selector.set_hardware(machine(16, 16))
    config = RunConfig.from_dict({"model": {"name": "llama-3.1-8b"}, "data": {"tokens_per_batch": 2048}})
    selector.show_plan(config)
    assert "FSDP2" in selector.plan.text() and "sharded over 2 GPUs" in selector.plan.text()


def test_one_card_or_none_needs_no_choice(qtbot: Any) -> None:
    from app.widgets.gpu_selector import GpuSelector

    selector = GpuSelector()
    qtbot.addWidget(selector)
    selector.set_hardware(machine(8))
    assert not selector.boxes and selector.title.text().startswith("Trains on: GPU 0")
    selector.set_hardware(SimpleNamespace(gpus=()))
    assert selector.title.text() == "Trains on: the CPU" and selector.selected() == []


def test_each_gpu_gets_its_own_lane(qtbot: Any) -> None:
    from app.widgets.run_charts import RunCharts
    from engine.hardware.telemetry import TelemetrySample

    charts = RunCharts()
    qtbot.addWidget(charts)
    charts.set_gpus((0, 1))
    for index, used in ((0, 10), (1, 14), (0, 11), (1, 15)):
        charts.add_sample(
            TelemetrySample(
                1.0, index, used * GIB, 24 * GIB, None, 90.0 + index, None, 60.0, None, None, None, None, (), None
            ),
            None,
        )
    charts.redraw_all()
    assert charts.lane_buffers(0)["used"] == [10.0, 11.0] and charts.lane_buffers(1)["used"] == [14.0, 15.0]
    assert charts.lane_buffers(1)["util"] == [91.0, 91.0]
    names = [item.name() for item in charts.memory.plotItem.listDataItems()]
    assert {"GPU 0 used", "GPU 1 used"} <= set(names)
    charts.clear()
    assert not charts.lanes and not charts.memory.plotItem.listDataItems()


def test_two_gpu_run_view_screenshot(qtbot: Any) -> None:
    """What a user with two cards sees: the selector with its plan, and a memory and load lane per GPU."""
    from pathlib import Path

    from PySide6.QtWidgets import QVBoxLayout, QWidget

    from app.widgets.gpu_selector import GpuSelector
    from app.widgets.run_charts import RunCharts
    from engine.config import RunConfig
    from engine.hardware.telemetry import TelemetrySample

    page = QWidget()
    selector, charts = GpuSelector(), RunCharts()
    layout = QVBoxLayout(page)
    layout.addWidget(selector)
    layout.addWidget(charts, 1)
    qtbot.addWidget(page)
    page.resize(1100, 640)
    selector.set_hardware(machine(24, 24))
    selector.show_plan(RunConfig.from_dict({"model": {"name": "llama-3.2-1b"}}))
    charts.set_device("cuda")
    charts.set_gpus((0, 1))
    for second in range(40):
        for index in (0, 1):
            used = 6 + min(second, 8) * 1.9 + 0.4 * index
            sample = TelemetrySample(
                float(second), index, int(used * GIB), 24 * GIB, None, 94.0 - 3 * index, None,
                55.0 + second * 0.5 + 2 * index, None, None, None, None, (), None,
            )  # fmt: skip
            charts.add_sample(sample, None)
    charts.redraw_all()
    page.show()
    qtbot.waitExposed(page, timeout=HANG_MS)
    folder = Path(__file__).resolve().parent.parent / "artifacts" / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    assert page.grab().save(str(folder / "run-two-gpus.png"))
    assert len(charts.lanes) == 2
