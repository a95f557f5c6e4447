"""The Speed page says only what is so after Compare: a switch Compare flipped is not one "you switched", a switch
measured over fewer rounds than planned shows no spread, and switches that cannot apply to a CPU run are listed as
not applicable rather than measured. The tests play the engine: they send the run's events to the page."""

from __future__ import annotations

from typing import Any

from app.background import run_controller as rc
from app.background.ab_compare import NEEDS_A_GPU, SWITCHES, TITLES
from engine.config import RunConfig, SpeedConfig
from engine.events import RunFinished, RunStarted, SpeedChanged, StepMetrics

pytest_plugins = ["app_fixtures"]

CPU_STATE: dict[str, dict[str, Any]] = {
    "metadata_cache": {"on": True, "reason": "best available backend for cpu float32"},
    "moe_routing": {"mode": "stock", "reason": "no MoE expert layers in this model"},
    "fused_loss": {"on": True, "reason": "automatic: loss and gradient from the hidden states in chunks"},
    "checkpointing": {"mode": "none", "reason": "CPU: host memory is plentiful, recompute would only cost time"},
    "chunked_mlp": {"on": False, "reason": "automatic: off without checkpointing (every activation is kept anyway)"},
    "host_embedding": {"on": False, "reason": "the model already lives in host memory"},
    "lora_16bit": {"on": False, "reason": "the model computes in float32: the adapters already match it"},
    "dequant_once": {"on": False, "reason": "no 4-bit projections to dequantize"},
    "fp8_base": {"on": False, "reason": "fp8 products need an NVIDIA GPU with fp8 tensor cores"},
    "fused_kernels": {"on": False, "reason": "automatic: off on CPU (inductor's CPU compile takes ~15 s per model)"},
    "resident_layers": {"on": False, "reason": "only under checkpointing"},
    "step_graphs": {"on": False, "reason": "automatic: off; CUDA graphs need an NVIDIA GPU"},
}
"""What the engine reports for the demo on a CPU at the start of a run (engine.run.session)."""


def cpu_run_started(window: Any) -> tuple[Any, list[SpeedConfig]]:
    """The Speed page on a running CPU job whose speed requests the test records instead of a run thread."""
    panel, controller = window.speed_panel, window.controller
    requested: list[SpeedConfig] = []
    controller.config = RunConfig()  # the run's settings, which the controller keeps up to date with each request
    ask = controller.request_speed
    controller.request_speed = lambda settings: (requested.append(settings), ask(settings))
    controller._set_state(rc.LOADING)
    controller.run_event.emit(RunStarted("runs/x", "cpu", "float32", 60, 0, 100, 2, 10, 0.98, 1000, 100_000))
    controller._set_state(rc.RUNNING)
    controller.speed_state = CPU_STATE
    controller.run_event.emit(SpeedChanged(0, CPU_STATE))
    panel.rounds.setValue(2)
    panel.block.setValue(2)
    return panel, requested


def flipped(state: dict[str, dict[str, Any]], switch: str, on: bool) -> dict[str, dict[str, Any]]:
    """The engine's state once ``switch`` was asked for explicitly (engine.speed.decide's reasons)."""
    words = "switched on; as asked" if on else "switched off: as asked"
    return {**state, switch: {**state[switch], "on": on, "reason": words}}


def test_switches_that_need_a_gpu_are_not_applicable_on_a_cpu_run_and_never_measured(window: Any) -> None:
    panel, requested = cpu_run_started(window)
    for name in NEEDS_A_GPU:
        assert panel.results[name].text() == "not applicable here", name
        assert panel.reasons[name].text().startswith("Not here — not applicable on the CPU: "), name
    panel.compare_button.click()
    step = 0
    while panel.compare is not None:  # every switch Compare measures, to the end
        window.controller.run_event.emit(SpeedChanged(step, CPU_STATE))
        for _ in range(2):
            step += 1
            window.controller.run_event.emit(StepMetrics(step, 600, 0.1, 1.0, 1e-4, 1.0, 256, 200, 0.2, 1e3, 1 << 30))
    asked = {name for name in SWITCHES for r in requested if getattr(r, name) != getattr(SpeedConfig(), name)}
    assert asked and asked.isdisjoint(NEEDS_A_GPU), f"Compare asked for {asked}"
    for name in NEEDS_A_GPU:
        assert panel.measured[name].short() == panel.results[name].text() == "not applicable here", name
    assert "fused_loss" in asked and "%" in panel.results["fused_loss"].text(), "what applies is measured"


def test_a_switch_compare_flipped_is_not_said_to_be_the_users_and_a_cut_short_one_shows_no_spread(
    window: Any,
) -> None:
    controller = window.controller
    panel, requested = cpu_run_started(window)
    panel.compare_button.click()
    first = panel.compare.switch
    step = 0
    for on in (True, False):  # one round of two: the switch on, then off, as Compare asks
        assert getattr(requested[-1], first) is on
        controller.run_event.emit(SpeedChanged(step, flipped(CPU_STATE, first, on)))
        assert "you switched" not in panel.reasons[first].text(), "the user never touched it"
        assert f"Compare switched it {'on' if on else 'off'}" in panel.reasons[first].text()
        for rate in (100.0, 1000.0 if on else 900.0):
            step += 1
            controller.run_event.emit(StepMetrics(step, 60, 0.1, 1.0, 1e-4, 1.0, 256, 200, 0.2, rate, 1 << 30))
    controller.run_event.emit(RunFinished(step, "runs/x", "runs/x/adapter", 1.0, None, 5.0, cancelled=True))
    cell = panel.results[first].text()
    assert cell == "+11.1% (1 of 2 rounds: not measured in full)", cell
    assert "±" not in cell and "±" not in panel.results[first].toolTip()
    assert f"{TITLES[first]} measured over 1 of 2 rounds" in panel.compare_status.text()
    assert "you switched" not in panel.reasons[first].text(), "the run ended with Compare's flip: still not yours"


def test_a_switch_the_user_flipped_is_theirs_before_and_after_compare(window: Any) -> None:
    controller = window.controller
    panel, requested = cpu_run_started(window)
    panel.on_off["fused_loss"].setChecked(False)  # the user's own flip
    assert requested[-1].fused_loss is False
    controller.run_event.emit(SpeedChanged(3, flipped(CPU_STATE, "fused_loss", False)))
    assert panel.reasons["fused_loss"].text().startswith("Off — you switched it off")
    panel.compare_button.click()
    controller.run_event.emit(SpeedChanged(4, flipped(flipped(CPU_STATE, "fused_loss", False), panel.compare.switch,
                                                      True)))  # fmt: skip
    assert panel.reasons["fused_loss"].text().startswith("Off — you switched it off"), "still the user's"
