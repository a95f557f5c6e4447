"""The live charts of a run that learns from rewards (GRPO): mean reward, answer length and KL per step.

The reward chart draws the total (the weighted sum the advantages come from) and each reward's own mean before its
weight, so a user sees which reward moves and which is stuck; the held-out prompts' mean reward (greedy answers, at
each evaluation) is drawn as dots. Answer length shows an answer growing to the token limit or collapsing to
nothing; KL shows how far the adapter has moved from the base model (a run without a KL penalty has none to draw).

As in the run's other charts (app.widgets.run_charts), figures go into plain buffers as events arrive and a timer
redraws what changed, one chart a tick; the wheel scrolls the page (app.widgets.page_chart); each run starts
fitted to its own figures.
"""

from __future__ import annotations

from typing import Any

import pyqtgraph as pg
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QHBoxLayout, QWidget

from app.theme import current_chart_colors, style_plot
from app.widgets.page_chart import PageChart
from app.widgets.run_charts import REDRAW_MS, configure_plots
from engine.events import StepMetrics

TOTAL = "total (weighted sum)"
REWARD_COLORS = ("#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")
CHARTS = ("reward", "length", "kl")
KL_TITLE = "KL to the base model (per answer token)"
NO_KL_TITLE = "KL: none to draw (this run has no KL penalty)"


class RewardCharts(QWidget):
    """Mean reward (total, each reward, held-out), answer length and KL, per step."""

    def __init__(self) -> None:
        super().__init__()
        configure_plots()
        self.reward = self._plot("Mean reward (total and each reward)", "reward")
        self.length = self._plot("Answer length (mean tokens)", "tokens")
        self.kl = self._plot(KL_TITLE, "KL")
        self.reward.addLegend(offset=(-10, 10))
        self.total_curve = self.reward.plot(antialias=False, pen=pg.mkPen("#1f77b4", width=3), name=TOTAL)
        self.held_out_dots = self.reward.plot(
            antialias=False, pen=None, symbol="o", symbolBrush="#d62728", name="held-out (greedy)"
        )
        self.length_curve = self.length.plot(antialias=False, pen=pg.mkPen("#17becf", width=2))
        self.kl_curve = self.kl.plot(antialias=False, pen=pg.mkPen("#9467bd", width=2))
        self.reward_curves: dict[str, Any] = {}
        """Each reward's curve, made when its name first arrives."""
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        for plot in (self.reward, self.length, self.kl):
            layout.addWidget(plot)
        self.buffers: dict[str, list[float]] = {}
        self.per_reward: dict[str, tuple[list[float], list[float]]] = {}
        self._dirty: set[str] = set()
        self.clear()
        self.timer = QTimer(self, interval=REDRAW_MS)
        self.timer.timeout.connect(self.redraw)
        self.timer.start()

    def _plot(self, title: str, left: str) -> PageChart:
        plot = PageChart(title=title)
        plot.setLabel("bottom", "step")
        plot.setLabel("left", left)
        plot.showGrid(x=True, y=True, alpha=0.2)
        style_plot(plot, current_chart_colors())
        return plot

    def clear(self) -> None:
        """Empty charts for a new run."""
        names = ("step", "reward", "length", "kl_step", "kl", "eval_step", "eval_reward")
        self.buffers = {name: [] for name in names}
        for curve in self.reward_curves.values():
            self.reward.removeItem(curve)  # a legend entry goes with its curve
        self.reward_curves = {}
        self.per_reward = {}
        self.kl.setTitle(KL_TITLE)
        for plot in (self.reward, self.length, self.kl):
            plot.getViewBox().enableAutoRange()
        self._dirty = set(CHARTS)

    def add_step(self, metrics: StepMetrics) -> None:
        """A step's reward figures (a step without them, not a reward run's, is left out)."""
        if metrics.reward_mean is None:
            return
        step = float(metrics.step)
        self.buffers["step"].append(step)
        self.buffers["reward"].append(metrics.reward_mean)
        self.buffers["length"].append(metrics.completion_length or 0.0)
        for name, mean in (metrics.reward_means or {}).items():
            steps, means = self.per_reward.setdefault(name, ([], []))
            steps.append(step)
            means.append(mean)
        if metrics.kl is not None:
            self.buffers["kl_step"].append(step)
            self.buffers["kl"].append(metrics.kl)
        self._dirty.update(CHARTS)

    def add_held_out(self, step: int, reward_mean: float) -> None:
        """An evaluation's mean reward of greedy answers to the held-out prompts."""
        self.buffers["eval_step"].append(float(step))
        self.buffers["eval_reward"].append(reward_mean)
        self._dirty.add("reward")

    def set_kl_penalty(self, on: bool) -> None:
        """Say on the KL chart why it stays empty when the run has no KL penalty."""
        self.kl.setTitle(KL_TITLE if on else NO_KL_TITLE)
        style_plot(self.kl, current_chart_colors())

    def redraw(self) -> None:
        """Redraw the next changed chart (one a tick, as the run's other charts do)."""
        for chart in CHARTS:
            if chart in self._dirty:
                self._dirty.discard(chart)
                getattr(self, f"_draw_{chart}")()
                return

    def redraw_all(self) -> None:
        while self._dirty:
            self.redraw()

    def _draw_reward(self) -> None:
        self.total_curve.setData(self.buffers["step"], self.buffers["reward"])
        self.held_out_dots.setData(self.buffers["eval_step"], self.buffers["eval_reward"])
        for name, (steps, means) in self.per_reward.items():
            if name not in self.reward_curves:
                color = REWARD_COLORS[len(self.reward_curves) % len(REWARD_COLORS)]
                pen = pg.mkPen(color, width=1, style=pg.QtCore.Qt.PenStyle.DashLine)
                self.reward_curves[name] = self.reward.plot(antialias=False, pen=pen, name=name)
                style_plot(self.reward, current_chart_colors())  # the new legend entry in the look's text colour
            self.reward_curves[name].setData(steps, means)

    def _draw_length(self) -> None:
        self.length_curve.setData(self.buffers["step"], self.buffers["length"])

    def _draw_kl(self) -> None:
        self.kl_curve.setData(self.buffers["kl_step"], self.buffers["kl"])
