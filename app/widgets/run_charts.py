"""The live charts of a run: data is appended into plain buffers as events arrive and drawn on a timer.

Memory and GPU load have one lane per GPU (a run on two cards draws two memory and two utilisation lines), so
an imbalance between the cards shows at a glance.

Drawing on every event would redraw up to hundreds of times a second on a fast GPU. Instead a timer redraws at
most one changed chart per tick: repainting all four at once took 50-90 ms on a busy two-core machine (enough
to make the window stutter), one chart takes 3-13 ms. Lines are drawn without antialiasing for the same reason
(2-4x cheaper to paint).

Speed changes are dotted lines on the tokens/s chart without text: an A/B compare flips a switch every few steps,
and text labels there overlapped or had to be dropped. Pointing at the chart names the nearest change in one
readout at the top of the chart, so labels never overlap at any zoom.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyqtgraph as pg
from PySide6.QtCore import QPointF, QTimer
from PySide6.QtWidgets import QGridLayout, QLabel, QWidget

from app.theme import current_chart_colors, style_plot
from app.widgets.page_chart import PageChart
from engine.run.summary import format_gib, measured_kind

GIB = 1 << 30
REDRAW_MS = 80
CHARTS = ("loss", "speed", "memory", "gpu")
LANE_COLORS = ("#9467bd", "#2ca02c", "#1f77b4", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
LANE_FIELDS = ("t", "used", "total", "gpu_t", "util", "temp")
MARK_HOVER_PX = 8
"""How close (in pixels) the pointer must be to a change's line for the readout to name it."""
MARK_COLOR = "#d62728"
PEAK_COLOR = "#d62728"


def nearest_mark(marks: Sequence[tuple[int, str]], step: float, steps_per_px: float) -> tuple[int, str] | None:
    """The change whose line is nearest to ``step``, if within :data:`MARK_HOVER_PX` pixels of it."""
    if not marks:
        return None
    best = min(marks, key=lambda mark: abs(mark[0] - step))
    return best if abs(best[0] - step) <= MARK_HOVER_PX * steps_per_px else None


class Lane:
    """One GPU's (or, on a CPU run, the process's) memory and load curves and their data."""

    def __init__(self, charts: RunCharts, label: str, color: str, single: bool) -> None:
        self.buffers: dict[str, list[float]] = {name: [] for name in LANE_FIELDS}
        dashed = pg.QtCore.Qt.PenStyle.DashLine
        prefix = "" if single else f"{label} "
        util_color, temp_color = ("#2ca02c", "#ff7f0e") if single else (color, color)
        self.used = charts.memory.plot(antialias=False, pen=pg.mkPen(color, width=2), name=f"{prefix}used")
        self.total = charts.memory.plot(
            antialias=False, pen=pg.mkPen("#999" if single else color, style=dashed), name=f"{prefix}total"
        )
        self.util = charts.gpu.plot(
            antialias=False,
            pen=pg.mkPen(util_color, width=2),
            name=f"{prefix}utilisation %" if single else f"{label} %",
        )
        self.temp = charts.gpu.plot(
            antialias=False,
            pen=pg.mkPen(
                temp_color, width=2 if single else 1, style=pg.QtCore.Qt.PenStyle.SolidLine if single else dashed
            ),
            name="temperature °C" if single else f"{label} °C",
        )

    def draw_memory(self) -> None:
        b = self.buffers
        self.used.setData(b["t"], b["used"])
        if any(b["total"]):
            self.total.setData(b["t"], b["total"])

    def draw_gpu(self) -> None:
        b = self.buffers
        self.util.setData(b["gpu_t"], b["util"])
        self.temp.setData(b["gpu_t"], b["temp"])


def configure_plots() -> None:
    """Charts in the window's colours (light or dark); call before creating plot widgets."""
    colors = current_chart_colors()
    pg.setConfigOptions(antialias=False, background=colors.background, foreground=colors.foreground)


class RunCharts(QWidget):
    """Loss (train and eval) per step; memory against the total over time, with the largest step peak dashed; GPU
    load and temperature; tokens/s."""

    def __init__(self) -> None:
        super().__init__()
        configure_plots()
        self.loss = self._plot("Loss", "step", "loss")
        self.memory = self._plot("Memory (GiB)", "seconds", "GiB")
        self.gpu = self._plot("GPU utilisation % and temperature °C", "seconds", "")
        self.speed = self._plot("Tokens/s (dotted: a switch changed)", "step", "tokens/s")
        for plot in (self.loss, self.memory, self.gpu):  # tokens/s has one curve and labelled marks: no legend
            plot.addLegend(offset=(-10, 10))
        self.train_curve = self.loss.plot(antialias=False, pen=pg.mkPen("#1f77b4", width=2), name="train")
        self.eval_curve = self.loss.plot(antialias=False, pen=None, symbol="o", symbolBrush="#d62728", name="eval")
        self.throttle_dots = self.gpu.plot(
            antialias=False, pen=None, symbol="t", symbolBrush="#d62728", name="throttled"
        )
        self.speed_curve = self.speed.plot(antialias=False, pen=pg.mkPen("#17becf", width=2), name="tokens/s")
        self.step_peak = 0
        """The largest step peak so far (StepMetrics.memory_bytes: reserved GPU memory, or RSS on a CPU run)."""
        self.peak_kind = measured_kind("cuda")
        """What the step peak counts, in the words of the run's summary (engine.run.summary.measured_kind)."""
        self.peak_line = pg.InfiniteLine(
            angle=0,
            pen=pg.mkPen(PEAK_COLOR, style=pg.QtCore.Qt.PenStyle.DashLine),
            label="",
            labelOpts={"position": 0.15},
        )
        self.memory.addItem(self.peak_line)
        self.mark_readout: QLabel | None = None
        """The readout naming the change under the pointer; made the first time it is needed."""
        self.speed.scene().sigMouseMoved.connect(self._pointer_moved)
        self.speed.getViewBox().sigRangeChanged.connect(lambda *_: self._hide_readout())  # zoomed: it is stale
        layout = QGridLayout(self)
        layout.addWidget(self.loss, 0, 0)
        layout.addWidget(self.speed, 0, 1)
        layout.addWidget(self.memory, 1, 0)
        layout.addWidget(self.gpu, 1, 1)
        self.buffers: dict[str, list[float]] = {}
        self.lanes: dict[int | None, Lane] = {}
        self.gpu_indices: tuple[int, ...] = ()
        self.marks: list[tuple[int, str]] = []
        self._dirty: set[str] = set()
        self.clear()
        self.timer = QTimer(self, interval=REDRAW_MS)
        self.timer.timeout.connect(self.redraw)
        self.timer.start()

    def _plot(self, title: str, bottom: str, left: str) -> pg.PlotWidget:
        plot = PageChart(title=title)
        plot.setLabel("bottom", bottom)
        if left:
            plot.setLabel("left", left)
        plot.showGrid(x=True, y=True, alpha=0.2)
        style_plot(plot, current_chart_colors())
        return plot

    def clear(self) -> None:
        names = ("step", "loss", "eval_step", "eval_loss", "throttle_t", "throttle_y", "speed_step", "speed")
        self.buffers = {name: [] for name in names}
        for lane in self.lanes.values():
            for curve in (lane.used, lane.total):
                self.memory.removeItem(curve)
            for curve in (lane.util, lane.temp):
                self.gpu.removeItem(curve)
        self.lanes = {}
        for line in getattr(self, "_mark_lines", []):
            self.speed.removeItem(line)
        self._mark_lines: list[Any] = []
        self._drawn_marks: tuple[tuple[int, str], ...] = ()
        self.marks = []
        self.step_peak = 0
        self.peak_line.hide()
        for plot in (self.loss, self.memory, self.gpu, self.speed):  # each run starts fitted to its own figures
            plot.getViewBox().enableAutoRange()
        if getattr(self, "mark_readout", None) is not None:
            self._hide_readout()
        self._dirty = set(CHARTS)

    def add_step(self, step: int, loss: float, tokens_per_s: float) -> None:
        self._append("loss", step=step, loss=loss)
        self._append("speed", speed_step=step, speed=tokens_per_s)

    def add_step_peak(self, memory_bytes: int) -> None:
        """A step's true peak: the memory chart marks the largest so far with a dashed line. It counts the reserved
        memory (step graphs' pool included), which the card's used memory already holds, so the line sits below it."""
        if memory_bytes > self.step_peak:
            self.step_peak = memory_bytes
            self._dirty.add("memory")

    def add_eval(self, step: int, loss: float) -> None:
        self._append("loss", eval_step=step, eval_loss=loss)

    @property
    def used_curve(self) -> Any:
        """The first lane's memory line (the only one on a one-GPU or CPU run)."""
        first = self.gpu_indices[0] if self.gpu_indices else None
        return self._lane(next(iter(self.lanes), first)).used

    def set_gpus(self, indices: tuple[int, ...]) -> None:
        """The cards of the next run: with more than one, every lane is labelled with its GPU."""
        self.gpu_indices = tuple(indices)

    def lane_buffers(self, gpu_index: int | None) -> dict[str, list[float]]:
        return self._lane(gpu_index).buffers

    def _lane(self, gpu_index: int | None) -> Lane:
        if gpu_index not in self.lanes:
            color = LANE_COLORS[len(self.lanes) % len(LANE_COLORS)]
            label = f"GPU {gpu_index}" if gpu_index is not None else "process"
            self.lanes[gpu_index] = Lane(self, label, color, single=len(self.gpu_indices) <= 1)
        return self.lanes[gpu_index]

    def add_memory(self, time_s: float, used_bytes: int, total_bytes: int | None, gpu_index: int | None = None) -> None:
        self._append_lane(gpu_index, "memory", t=time_s, used=used_bytes / GIB, total=(total_bytes or 0) / GIB)

    def add_gpu(
        self,
        time_s: float,
        utilization: float | None,
        temperature: float | None,
        throttled: bool,
        gpu_index: int | None = None,
    ) -> None:
        if utilization is None and temperature is None:
            return
        self._append_lane(gpu_index, "gpu", gpu_t=time_s, util=utilization or 0.0, temp=temperature or 0.0)
        if throttled:
            self._append("gpu", throttle_t=time_s, throttle_y=temperature or 0.0)

    def add_sample(self, sample: Any, host_memory_bytes: int | None) -> None:
        """One telemetry sample: the card's memory (the process's RAM on a CPU run), load, temperature, throttling."""
        used = sample.memory_used_bytes if sample.memory_used_bytes is not None else sample.process_rss_bytes
        total = sample.memory_total_bytes if sample.memory_total_bytes is not None else host_memory_bytes
        lane = sample.gpu_index
        if used is not None:
            self.add_memory(sample.time_s, used, total, lane)
        self.add_gpu(sample.time_s, sample.utilization_pct, sample.temperature_c, bool(sample.throttle_reasons), lane)

    def load_history(self, run_dir: Path, up_to_step: int) -> None:
        """A resumed run's curves start where it stopped: draw the steps already in its logs (newer lines may be
        there already; their events are on the way and draw themselves)."""
        for name, add in (("metrics.jsonl", self._add_logged_step), ("eval.jsonl", self._add_logged_eval)):
            with contextlib.suppress(OSError):
                for line in (run_dir / name).read_text(encoding="utf-8").splitlines():
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        record = json.loads(line)
                        if int(record["step"]) <= up_to_step:
                            add(record)

    def _add_logged_step(self, record: dict[str, Any]) -> None:
        self.add_step(int(record["step"]), float(record["loss"]), float(record["tokens_per_s"]))

    def _add_logged_eval(self, record: dict[str, Any]) -> None:
        self.add_eval(int(record["step"]), float(record["eval_loss"]))

    def mark_speed_change(self, step: int, label: str) -> None:
        """A vertical line on the tokens/s chart where a switch changed."""
        self.marks.append((step, label))
        self._dirty.add("speed")

    def set_device(self, device: str) -> None:
        """Name what the memory chart shows, and say why the GPU chart stays empty on a CPU run."""
        on_gpu = device.startswith("cuda")
        self.memory.setTitle(
            "GPU memory in use on the card (driver) vs its total (GiB)" if on_gpu else "Process memory vs RAM (GiB)"
        )
        self.peak_kind = measured_kind(device)
        self.gpu.setTitle("GPU utilisation % and temperature °C" if on_gpu else "GPU: none (this run is on the CPU)")
        self.gpu.plotItem.legend.setVisible(on_gpu)

    def _append_lane(self, gpu_index: int | None, chart: str, **values: float) -> None:
        buffers = self._lane(gpu_index).buffers
        for name, value in values.items():
            buffers[name].append(float(value))
        self._dirty.add(chart)

    def _append(self, chart: str, **values: float) -> None:
        for name, value in values.items():
            self.buffers[name].append(float(value))
        self._dirty.add(chart)

    def redraw(self) -> None:
        """Redraw the next changed chart (in a fixed order, so none waits more than four ticks)."""
        for chart in CHARTS:
            if chart in self._dirty:
                self._dirty.discard(chart)
                getattr(self, f"_draw_{chart}")()
                return

    def redraw_all(self) -> None:
        while self._dirty:
            self.redraw()

    def _draw_loss(self) -> None:
        self.train_curve.setData(self.buffers["step"], self.buffers["loss"])
        self.eval_curve.setData(self.buffers["eval_step"], self.buffers["eval_loss"])

    def _draw_memory(self) -> None:
        for lane in self.lanes.values():
            lane.draw_memory()
        if self.step_peak:
            self.peak_line.setValue(self.step_peak / GIB)
            self.peak_line.label.setFormat(f"largest step peak: {format_gib(self.step_peak)} ({self.peak_kind})")
            self.peak_line.show()

    def _draw_gpu(self) -> None:
        for lane in self.lanes.values():
            lane.draw_gpu()
        self.throttle_dots.setData(self.buffers["throttle_t"], self.buffers["throttle_y"])

    def _draw_speed(self) -> None:
        self.speed_curve.setData(self.buffers["speed_step"], self.buffers["speed"])
        self._draw_marks()

    def _draw_marks(self) -> None:
        """Every speed change as a dotted line; the lines are rebuilt only when a change was added."""
        drawn = tuple(self.marks)
        if drawn == self._drawn_marks:
            return
        for line in self._mark_lines:
            self.speed.removeItem(line)
        pen = pg.mkPen(MARK_COLOR, style=pg.QtCore.Qt.PenStyle.DotLine)
        self._mark_lines = []
        for step, label in drawn:
            line = pg.InfiniteLine(pos=step, angle=90, pen=pen)
            line.setToolTip(f"step {step}: {label}")
            self.speed.addItem(line, ignoreBounds=True)
            self._mark_lines.append(line)
        self._drawn_marks = drawn

    def _hide_readout(self) -> None:
        if self.mark_readout is not None:
            self.mark_readout.hide()

    def _pointer_moved(self, scene_pos: Any) -> None:
        box = self.speed.getViewBox()
        if not box.sceneBoundingRect().contains(scene_pos):
            self._hide_readout()
            return
        self.show_mark_near(box.mapSceneToView(scene_pos).x())

    def show_mark_near(self, step: float) -> str:
        """Name the change nearest to ``step`` at the top of the chart; returns the text shown ("" for none)."""
        box = self.speed.getViewBox()
        (left, right), (_, top) = box.viewRange()
        mark = nearest_mark(self.marks, step, (right - left) / max(1.0, box.width()))
        if mark is None:
            self._hide_readout()
            return ""
        text = f"step {mark[0]}: {mark[1]}"
        colors = current_chart_colors()
        if self.mark_readout is None:
            self.mark_readout = QLabel(self.speed)
        readout = self.mark_readout
        readout.setStyleSheet(f"background:{colors.background}; color:{colors.foreground}; "
                              f"border:1px solid {MARK_COLOR}; padding:1px 4px")  # fmt: skip
        readout.setText(text)
        readout.adjustSize()
        area = self.speed.mapFromScene(box.sceneBoundingRect()).boundingRect()
        x = self.speed.mapFromScene(box.mapViewToScene(QPointF(mark[0], top))).x()
        x = x - readout.width() if mark[0] > (left + right) / 2 else x  # stays inside the chart
        readout.move(max(area.left(), min(x, area.right() - readout.width())), area.top() + 2)
        readout.show()
        return text
