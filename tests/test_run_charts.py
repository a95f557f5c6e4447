"""Speed-change marks on the tokens/s chart: every change drawn, labels only where they stay readable."""

from __future__ import annotations

from typing import Any

import pytest

from app.run_charts import MARK_ROWS, place_labels

pytest_plugins = ["app_fixtures"]


@pytest.mark.parametrize(
    ("steps", "widths", "steps_per_px", "places"),
    [
        ([10, 40, 70], [50, 50, 50], 0.1, [(0, False)] * 3),  # far apart: one row
        ([10, 12, 14], [50, 50, 50], 0.1, [(0, False), (1, False), (2, False)]),  # close: they climb down the rows
        ([10, 11, 12, 13, 14], [50] * 5, 0.1, [(0, False), (1, False), (2, False), None, None]),  # line only
        ([10, 11, 12, 13, 17], [50] * 5, 0.1, [(0, False), (1, False), (2, False), None, (0, False)]),
        ([10, 11, 12, 13, 14], [50] * 5, 0.01, [(0, False)] * 5),  # zoomed in: all fit
        ([], [], 0.1, []),
    ],
)
def test_labels_take_the_first_free_row(steps: list, widths: list, steps_per_px: float, places: list) -> None:
    assert place_labels(steps, widths, steps_per_px) == places


def test_a_label_at_the_right_edge_runs_left_of_its_line() -> None:
    assert place_labels([10, 95], [50, 50], 0.1, right_edge=100) == [(0, False), (0, True)]
    assert place_labels([92, 95], [50, 50], 0.1, right_edge=100) == [(0, False), (1, True)]  # 89.4-95 overlaps 92-97.6


def labelled(charts: Any) -> list[Any]:
    return [line.label for line in charts._mark_lines if getattr(line, "label", None) is not None]


def test_a_compare_s_dense_marks_never_overlap_and_zooming_in_shows_them(qtbot: Any) -> None:
    from app.run_charts import RunCharts

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
    shown = labelled(charts)
    assert 1 <= len(shown) < len(flips)
    boxes = [label.sceneBoundingRect() for label in shown]
    for i, box in enumerate(boxes):
        assert not any(box.intersects(other) for other in boxes[i + 1 :]), "two mark labels overlap"
    plot_area = charts.speed.getViewBox().sceneBoundingRect()
    assert all(plot_area.contains(box) for box in boxes), "a mark label runs off the chart"

    charts.speed.setXRange(8, 20, padding=0)  # zoomed in: the labels there have room
    charts.redraw_all()
    assert len(labelled(charts)) > len(shown) and len(labelled(charts)) >= MARK_ROWS

    charts.clear()
    charts.redraw_all()
    assert charts._mark_lines == [] and charts.marks == []
