"""Speed-change marks on the tokens/s chart: every change drawn as a line, named on pointing, never overlapping."""

from __future__ import annotations

from typing import Any

import pytest
from PySide6.QtCore import QPointF

from app.widgets.run_charts import nearest_mark

pytest_plugins = ["app_fixtures"]

MARKS = [(10, "cache off"), (12, "cache on"), (40, "kernels off")]


@pytest.mark.parametrize(
    ("step", "steps_per_px", "found"),
    [
        (10.2, 0.1, (10, "cache off")),
        (11.3, 0.1, (12, "cache on")),  # the nearest one wins
        (20.0, 0.1, None),  # 80 px from any line
        (20.0, 2.0, (12, "cache on")),  # zoomed far out: 4 px away
        (41.0, 0.1, None),
    ],
)
def test_the_nearest_change_within_a_few_pixels(step: float, steps_per_px: float, found: Any) -> None:
    assert nearest_mark(MARKS, step, steps_per_px) == found
    assert nearest_mark([], step, steps_per_px) is None


def test_a_compare_s_dense_marks_are_lines_and_pointing_names_one(qtbot: Any) -> None:
    import pyqtgraph as pg

    from app.widgets.run_charts import RunCharts

    charts = RunCharts()
    qtbot.addWidget(charts)
    charts.resize(1200, 700)
    charts.show()
    qtbot.waitExposed(charts)
    for step in range(1, 121):
        charts.add_step(step, 1.0, 4000.0)
    flips = [*range(8, 60, 2), 119]  # an A/B compare, a change every two steps, and one at the right edge
    for step in flips:
        charts.mark_speed_change(step, "kernels off" if step % 4 else "kernels on")
    charts.redraw_all()
    assert [line.value() for line in charts._mark_lines] == flips  # every change has its line
    assert all(line.toolTip().startswith(f"step {int(line.value())}: kernels") for line in charts._mark_lines)
    texts = [item for item in charts.speed.getPlotItem().items if isinstance(item, pg.TextItem)]
    assert texts == [] and charts.mark_readout is None, "no label until pointed at"

    box = charts.speed.getViewBox()
    box.updateAutoRange()
    middle = sum(box.viewRange()[1]) / 2
    charts.speed.scene().sigMouseMoved.emit(box.mapViewToScene(QPointF(20.1, middle)))
    assert charts.mark_readout.isVisible() and charts.mark_readout.text() == "step 20: kernels on"
    charts.speed.scene().sigMouseMoved.emit(box.mapViewToScene(QPointF(119, middle)))
    assert charts.mark_readout.text() == "step 119: kernels off"
    area = charts.speed.mapFromScene(box.sceneBoundingRect()).boundingRect()
    assert area.contains(charts.mark_readout.geometry()), "the readout at the right edge stays inside the chart"
    charts.speed.setXRange(0, 60)
    assert not charts.mark_readout.isVisible(), "zoomed or panned: the readout no longer points at its line"
    charts.speed.scene().sigMouseMoved.emit(box.mapViewToScene(QPointF(90, middle)))
    assert not charts.mark_readout.isVisible(), "no change near the pointer"

    charts.clear()
    charts.redraw_all()
    assert charts._mark_lines == [] and charts.marks == []


def test_the_memory_chart_marks_the_largest_step_peak_as_reserved_memory(qtbot: Any) -> None:
    from app.widgets.run_charts import RunCharts
    from engine.run.summary import RunSummary, describe

    charts = RunCharts()
    qtbot.addWidget(charts)
    charts.set_device("cuda:0")
    for peak in (6 * 2**30, int(7.5 * 2**30), 7 * 2**30):
        charts.add_step_peak(peak)
    charts.redraw_all()
    assert charts.peak_line.isVisible() and charts.peak_line.value() == 7.5
    assert charts.peak_line.label.format == "largest step peak: 7.50 GiB (GPU memory reserved)"
    assert "card (driver)" in charts.memory.getPlotItem().titleLabel.text
    charts.clear()
    charts.redraw_all()
    assert not charts.peak_line.isVisible() and charts.step_peak == 0
    on_gpu = RunSummary(device="cuda:0", peak_memory_bytes=3 * 2**29, driver_peak_bytes=2 * 2**30)
    assert describe(on_gpu).peak == "1.50 GiB (GPU memory reserved; 2.00 GiB as the driver sees it)"
    assert describe(RunSummary(device="cpu", peak_memory_bytes=2**30)).peak == "1.00 GiB (process memory)"
