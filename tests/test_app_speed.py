"""The Speed page: "On here?" in plain words, all on vs all off, and Compare's results drawn as bars with spread."""

from __future__ import annotations

from typing import Any

import pyqtgraph as pg
import pytest

from app.background import run_controller as rc
from app.background.ab_compare import ALL, SPEED_SWITCHES, TITLES, Measurement, switch_settings
from app.widgets.switch_words import describe_plan, describe_state
from engine.config import SpeedConfig
from engine.events import RunFinished, SpeedChanged, StepMetrics

pytest_plugins = ["app_fixtures"]

CPU_KERNELS = "automatic: off on CPU (inductor's CPU compile takes ~15 s per model and gains little)"


@pytest.mark.parametrize(
    ("switch", "entry", "idle", "text"),
    [
        ("fused_kernels", {"on": False, "reason": CPU_KERNELS}, None,
         "Off — TuneDeck's choice: on CPU (inductor's CPU compile takes ~15 s per model and gains little)"),
        ("fused_loss", {"on": True, "reason": "automatic: loss from the hidden states in chunks"}, None,
         "On — TuneDeck's choice: loss from the hidden states in chunks"),
        ("metadata_cache", {"on": False, "reason": "switched off: transformers' own packed path"}, None,
         "Off — you switched it off; instead: transformers' own packed path"),
        ("fused_kernels", {"on": True, "reason": "switched on; norms fused per layer"}, None,
         "On — you switched it on: norms fused per layer"),
        ("metadata_cache", {"on": True, "reason": "varlen: FlashAttention-2 for packed rows"}, None,
         "On — varlen: FlashAttention-2 for packed rows"),
        ("checkpointing", {"mode": "none", "reason": "CPU: host memory is plentiful"}, None,
         "Off (no checkpointing) — CPU: host memory is plentiful"),
        ("checkpointing", {"mode": "offloaded", "reason": "offloaded requested"}, None, "On — offloaded requested"),
        ("moe_routing", {"mode": "stock", "reason": "no MoE experts"}, "the model has no MoE expert layers",
         "Not here — the model has no MoE expert layers"),
    ],
)  # fmt: skip
def test_on_here_says_on_or_off_and_why_in_plain_words(switch: str, entry: dict, idle: Any, text: str) -> None:
    assert describe_state(switch, entry, idle) == text


def test_the_plan_before_a_run_says_what_will_be_chosen() -> None:
    assert describe_plan("metadata_cache", True, "metadata cache on: built once per batch") == (
        "Will be on — built once per batch"
    )
    assert describe_plan("checkpointing", "offloaded", "checkpointing offloaded: too big") == "Will be on — too big"
    assert describe_plan("moe_routing", "stock", "MoE routing: demo has no expert layers") == (
        "Will be off — demo has no expert layers"
    )


def test_all_on_is_tunedecks_choice_and_all_off_is_stock_leaving_memory_savers_alone() -> None:
    base = SpeedConfig(fused_loss=False, checkpointing="offloaded", chunked_mlp=True)
    on, off = switch_settings(base, ALL, True), switch_settings(base, ALL, False)
    assert all(getattr(on, name) is None for name in SPEED_SWITCHES) and on.moe_routing == "auto"
    assert all(getattr(off, name) is False for name in SPEED_SWITCHES) and off.moe_routing == "stock"
    for settings in (on, off):
        assert (settings.checkpointing, settings.chunked_mlp) == ("offloaded", True)


def test_the_page_lists_only_this_engine_s_settings_and_fp8_flips_between_all_and_off() -> None:
    """Settings that went from SpeedConfig (kept attention, LoRA groups, ...) leave the page; fp8 products take a
    value, so the page's check box means fp8 everywhere (on) or none (off)."""
    from dataclasses import fields

    from app.background.ab_compare import ON_OFF_SWITCHES, SWITCHES

    names = {f.name for f in fields(SpeedConfig)}
    assert set(SWITCHES) <= names and set(ON_OFF_SWITCHES) <= names
    assert {"keep_attention", "lora_groups", "cudnn_attention", "four_bit_kernel"}.isdisjoint(SWITCHES)
    base = SpeedConfig()
    assert switch_settings(base, "fp8_base", True).fp8_base == "all"
    assert switch_settings(base, "fp8_base", False).fp8_base == "off"
    assert switch_settings(base, "step_graphs", False).step_graphs is False


def bars(chart: Any) -> list[Any]:
    return [item for item in chart.getPlotItem().items if isinstance(item, pg.BarGraphItem)]


def test_the_chart_draws_a_bar_and_whisker_per_measured_switch(qtbot: Any) -> None:
    from app.widgets.compare_chart import CompareChart

    chart = CompareChart()
    qtbot.addWidget(chart)
    faster = Measurement("fused_loss", on=[1200.0], off=[1000.0], ratios=[1.18, 1.22])
    slower = Measurement("chunked_mlp", on=[900.0], off=[1000.0], ratios=[0.9, 0.9])
    skipped = Measurement("moe_routing", skipped_reason="no MoE expert layers")
    chart.show_results([("fused loss", faster), ("chunked MLP", slower), ("MoE routing", skipped)])
    drawn = bars(chart)
    assert len(drawn) == 2
    widths = sorted(float(bar.opts["width"][0]) for bar in drawn)
    assert widths == pytest.approx([10.0, 20.0])
    whiskers = [item for item in chart.getPlotItem().items if isinstance(item, pg.ErrorBarItem)]
    assert len(whiskers) == 1 and whiskers[0].opts["left"] == pytest.approx(faster.spread * 100)
    texts = sorted(item.toPlainText().strip() for item in chart.getPlotItem().items if isinstance(item, pg.TextItem))
    assert texts == ["+20.0% ± 2.8%", "-10.0% ± 0.0%", "nothing to do here"]
    ticks = chart.getPlotItem().getAxis("left")._tickLevels[0]
    assert [label for _, label in ticks] == ["fused loss", "chunked MLP", "MoE routing"]


def step_event(step: int, rate: float) -> StepMetrics:
    return StepMetrics(step, 100, 0.1, 1.0, 1e-4, 1.0, 256, 200, 0.2, rate, 1 << 30)


def test_all_on_vs_all_off_measures_them_together_and_draws_the_bar(window: Any) -> None:
    panel, controller = window.speed_panel, window.controller
    requested: list[SpeedConfig] = []
    controller.request_speed = requested.append  # no run thread: the test plays the engine
    controller._set_state(rc.RUNNING)
    assert panel.all_button.isEnabled() and panel.compare_button.isEnabled()
    panel.rounds.setValue(2)
    panel.block.setValue(2)
    panel.all_button.click()
    assert panel.compare is not None and panel.compare.switch == ALL
    assert not panel.all_button.isEnabled() and not panel.compare_button.isEnabled()
    step = 10
    while panel.compare is not None:
        all_on = requested[-1].fused_loss is None
        controller.run_event.emit(SpeedChanged(step, {}))
        for rate in (100.0, 1500.0 if all_on else 1000.0):  # the first step of a block is not counted
            step += 1
            controller.run_event.emit(step_event(step, rate))
    result = panel.measured[ALL]
    assert result.speedup == pytest.approx(1.5) and len(result.ratios) == 2
    assert "All speed switches together: 50.0% faster" in panel.compare_status.text()
    assert requested[-1] == SpeedConfig(), "the run's own settings come back at the end"
    assert [float(bar.opts["width"][0]) for bar in bars(panel.chart)] == pytest.approx([50.0])
    assert panel.all_button.isEnabled()


def test_a_run_that_ends_during_compare_leaves_the_page_ready_and_says_what_was_not_measured(window: Any) -> None:
    panel, controller = window.speed_panel, window.controller
    requested: list[SpeedConfig] = []
    controller.request_speed = requested.append  # no run thread: the test plays the engine
    controller._set_state(rc.RUNNING)
    panel.rounds.setValue(2)
    panel.block.setValue(2)
    panel.compare_button.click()
    first = panel.compare.switch
    controller.run_event.emit(SpeedChanged(10, {}))
    controller.run_event.emit(step_event(11, 100.0))
    asked = len(requested)
    controller.run_event.emit(RunFinished(11, "runs/x", "runs/x/adapter", 1.0, None, 5.0, cancelled=True))
    assert panel.compare is None and panel.queue == [] and len(requested) == asked  # nothing asked of an ended run
    status = panel.compare_status.text()
    assert status.startswith("The run ended before Compare finished: ") and f"{TITLES[first]}, " in status
    assert "not measured" in status and "measured over" not in status
    assert panel.measured[first].summary() == "not measured (the run ended first)"
    controller._set_state(rc.FINISHED)
    assert not panel.compare_button.isEnabled()  # a finished run has nothing to compare on
    controller._set_state(rc.RUNNING)
    assert panel.compare_button.isEnabled() and panel.all_button.isEnabled()


def test_a_switch_cut_short_by_the_runs_end_says_the_rounds_it_finished(window: Any) -> None:
    panel, controller = window.speed_panel, window.controller
    requested: list[SpeedConfig] = []
    controller.request_speed = requested.append  # no run thread: the test plays the engine
    controller._set_state(rc.RUNNING)
    panel.rounds.setValue(2)
    panel.block.setValue(2)
    panel.compare_button.click()
    first = panel.compare.switch
    step = 10
    for _block in range(2):  # one round: the switch on, then off
        controller.run_event.emit(SpeedChanged(step, {}))
        for rate in (100.0, 1000.0):
            step += 1
            controller.run_event.emit(step_event(step, rate))
    controller.run_event.emit(RunFinished(step, "runs/x", "runs/x/adapter", 1.0, None, 5.0, cancelled=True))
    status = panel.compare_status.text()
    assert f"{TITLES[first]} measured over 1 of 2 rounds" in status, status
    assert f"{TITLES[first]}, " not in status and f"{TITLES[first]} not measured" not in status
    assert panel.results[first].text() == panel.measured[first].short() and "%" in panel.results[first].text()
