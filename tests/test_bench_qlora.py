"""The QLoRA bench's variants and report: switches turned off (auto-X) and on (auto+X), losses per variant."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hang import HANG_S

from engine.bench.qlora import AUTO, loss_agreement, markdown, set_variant, variant_settings
from engine.config import SpeedConfig

REPORT = Path(__file__).resolve().parents[1] / "benchmarks" / "history" / "qlora_fp8_h200.json"


def test_variants_turn_one_switch_off_or_on() -> None:
    assert variant_settings("auto") == AUTO
    assert variant_settings("auto-fused_kernels").fused_kernels is False
    on = variant_settings("auto+fp8_base")
    assert on.fp8_base == "all" and on.fused_kernels is None  # everything else stays automatic
    assert variant_settings("auto-whole_row").attention_backend == "varlen"  # no cuDNN for one-document rows
    assert variant_settings("stock").fused_kernels is False


def test_the_stock_row_is_stock_with_step_graphs_off() -> None:
    """peft's documented QLoRA: standard checkpointing, every TuneDeck switch off, step graphs included."""
    stock = variant_settings("stock")
    assert stock == SpeedConfig.stock(checkpointing="standard")
    assert stock.step_graphs is False and stock.checkpointing == "standard" and stock.moe_routing == "stock"
    switches = [f.name for f in dataclasses.fields(SpeedConfig) if f.default is None]
    assert {name: getattr(stock, name) for name in switches} == dict.fromkeys(switches, False)
    assert "step_graphs" in switches and "resident_layers" in switches and stock.fp8_base == "off"


def test_bench_knobs_are_set_and_cleared_with_their_variant() -> None:
    """``auto-resident=N`` fixes the resident layers' count; ``+fp8_recompute_only`` keeps fp8 to the recompute; the
    next variant clears each."""
    applied: list[SpeedConfig] = []
    controller = SimpleNamespace(resident_override=None, apply=applied.append)
    set_variant(controller, "auto-resident=12")
    assert controller.resident_override == 12 and applied[-1].resident_layers is True
    set_variant(controller, "auto-resident_layers")
    assert controller.resident_override is None and applied[-1].resident_layers is False
    set_variant(controller, "auto+fp8_base+step_graphs+fp8_recompute_only+read_late")
    assert applied[-1].fp8_base == "recompute" and applied[-1].step_graphs
    set_variant(controller, "auto+fp8_base")
    assert applied[-1].fp8_base == "all"
    set_variant(controller, "auto-fp8_base")  # the 16-bit products where fp8 would be automatic
    assert applied[-1].fp8_base == "off"
    set_variant(controller, "stock")
    assert controller.resident_override is None and applied[-1].fused_kernels is False
    assert applied[-1].fp8_base == "off"


@pytest.mark.parametrize(
    "variant", ["auto+fused_kernels", "auto+nonsense", "auto+keep_attention", "auto-lora_groups", "auto+layer_regions"]
)
def test_a_variant_that_switches_nothing_is_refused(variant: str) -> None:
    with pytest.raises(ValueError, match="unknown variant"):
        variant_settings(variant)


def test_each_compared_variant_gets_its_loss_agreement() -> None:
    report = json.loads(REPORT.read_text(encoding="utf-8"))
    record = report["models"][0]
    auto, fp8 = loss_agreement(record, "auto"), loss_agreement(record, "auto+fp8_base")
    assert auto is not None and fp8 is not None
    assert fp8 > auto  # the fp8 products' rounding shows in the losses
    assert loss_agreement(record, "auto+step_graphs") is None  # not run: no number rather than a wrong one
    text = markdown(report)
    assert f"| llama-3.1-8b | auto+fp8_base | 20 | {fp8:.2e} |" in text
    assert f"| llama-3.1-8b | auto | 20 | {auto:.2e} |" in text
    assert "host-bound" in text  # the run's notes come with its table


def test_host_time_shows_where_a_row_measured_it() -> None:
    report = json.loads(REPORT.read_text(encoding="utf-8"))
    measured = copy.deepcopy(report)
    row = measured["models"][0]["rows"][0]
    row["host_ms"] = 401.4
    assert f"| {row['ms_per_step']:.0f} | 401 |" in markdown(measured)
    assert f"| {row['ms_per_step']:.0f} | - |" in markdown(report)  # measured before the column existed


STEP_GRAPHS = REPORT.with_name("qlora_step_graphs_h200.json")


def test_step_graph_rows_show_their_reserved_pool_and_their_losses_against_auto() -> None:
    report = json.loads(STEP_GRAPHS.read_text(encoding="utf-8"))
    record = report["models"][0]
    rows = {row["variant"]: row for row in record["rows"]}
    graphed = rows["auto+step_graphs"]
    assert graphed["reserved_gib"] > graphed["peak_gib"]  # the pool is reserved, not allocated, between replays
    assert graphed["ms_per_step"] < rows["auto"]["ms_per_step"] and graphed["host_ms"] < rows["auto"]["host_ms"]
    agreement = loss_agreement(record, "auto+step_graphs", "auto")
    assert agreement is not None and agreement < 1e-3  # replayed steps train as eager ones, within bf16 noise
    text = markdown(report)
    # measured before the true peak: its reserved peak is the true one, its peak_gib the allocated one
    true_then_allocated = f"| {graphed['reserved_gib']:.2f} | {graphed['peak_gib']:.2f} |"
    assert f"{true_then_allocated} {graphed['planned_peak_gib']:.2f} |" in text
    assert "| peak GiB (reserved) | allocated GiB | planned GiB |" in text
    assert f"| llama-3.1-8b | auto+step_graphs | 20 | - | {agreement:.2e} |" in text
    old = json.loads(REPORT.read_text(encoding="utf-8"))["models"][0]["rows"][0]
    assert f"| - | {old['peak_gib']:.2f} |" in markdown(json.loads(REPORT.read_text(encoding="utf-8")))
    graphed.update(peak_gib=7.71, true_peak_gib=7.71, allocated_peak_gib=6.05, reserved_gib=7.71)  # a new row
    assert f"| 7.71 | 6.05 | {graphed['planned_peak_gib']:.2f} |" in markdown(report)


def test_variants_may_switch_several_switches_on() -> None:
    both = variant_settings("auto+fp8_base+step_graphs")
    assert both.fp8_base == "all" and both.step_graphs is True and both.fused_kernels is None
    with pytest.raises(ValueError, match="unknown variant"):
        variant_settings("auto+fp8_base+nonsense")


def test_a_foreach_adamw_tail_keeps_the_switches_and_changes_only_the_optimizer() -> None:
    from engine.bench.qlora import optimizer_choice

    assert variant_settings("auto+fp8_base+step_graphs+foreach_adamw") == variant_settings("auto+fp8_base+step_graphs")
    assert variant_settings("auto+foreach_adamw") == AUTO
    assert optimizer_choice("auto+step_graphs+foreach_adamw") == "foreach" and optimizer_choice("auto") == "auto"
    report = json.loads(REPORT.read_text(encoding="utf-8"))
    assert "as `tunedeck train` runs" not in markdown(report)
    report["settings"] = {**report.get("settings", {}), "as_trainer": "True"}
    assert "as `tunedeck train --step-readout immediate` runs" in markdown(report)


def test_a_step_timed_as_the_trainer_clips_before_the_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--as-trainer`` clips the gradients to norm 1 (reading the norm) before the optimizer steps, as the training
    loop does; without it nothing is clipped. The returned loss is the same either way."""
    import torch

    events: list[str] = []
    clip = torch.nn.utils.clip_grad_norm_

    def recorded_clip(params: object, max_norm: float, *args: object, **kwargs: object) -> torch.Tensor:
        events.append(f"clip {max_norm}")
        return clip(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recorded_clip)
    without = _loss_at_update(events, as_trainer=False)
    assert events == ["step"]
    clipped = _loss_at_update(events, as_trainer=True)
    assert events == ["step", "clip 1.0", "step"] and without == clipped


def _loss_at_update(events: list[str], as_trainer: bool) -> float:
    import torch
    from speed_models import packed_batch, tiny_lora_model

    from engine.bench.speed import bench_adamw, train_step
    from engine.speed import SpeedController

    torch.manual_seed(0)
    model = tiny_lora_model("llama")
    controller = SpeedController(model, AUTO, torch.device("cpu"))
    optimizer = bench_adamw(model, 1e-3, "foreach")
    assert optimizer.defaults["fused"] is None
    optimizer.register_step_pre_hook(lambda *_: events.append("step"))
    return float(train_step(model, controller, packed_batch((30, 20)), optimizer, as_trainer=as_trainer))


def test_variant_tails_choose_the_optimizer_and_how_values_are_read() -> None:
    from engine.bench.qlora import optimizer_choice, split_tails, variant_settings

    assert split_tails("auto+fp8_base+read_late") == ("auto+fp8_base", {"read_late"})
    assert split_tails("auto+foreach_adamw+read_immediate") == ("auto", {"foreach_adamw", "read_immediate"})
    assert optimizer_choice("auto+step_graphs+foreach_adamw") == "foreach"
    assert variant_settings("auto+fp8_base+read_late").fp8_base == "all"
    with pytest.raises(ValueError, match="fused AdamW"):
        variant_settings("auto+foreach_adamw+read_late")


def test_late_readout_steps_make_the_updates_of_plain_steps() -> None:
    """The bench's late-readout rows train as its plain rows: same losses over three steps (fused AdamW on the CPU)."""
    import torch
    from speed_models import packed_batch, tiny_lora_model

    from engine.bench.qlora import LateReadout, step_function
    from engine.bench.speed import bench_adamw
    from engine.speed import SpeedController

    curves = []
    for variant in ("auto+read_late", "auto"):
        torch.manual_seed(0)
        model = tiny_lora_model("llama")
        controller = SpeedController(model, AUTO, torch.device("cpu"))
        step = step_function(variant, False, model, controller, bench_adamw(model, 1e-2, "fused"))
        assert isinstance(step, LateReadout) is (variant == "auto+read_late")
        curves.append([float(step(batch=packed_batch((30, 20)))) for _ in range(3)])
    assert curves[0] == pytest.approx(curves[1], rel=1e-6)
    assert curves[0][0] != pytest.approx(curves[0][2], rel=1e-4)  # the steps did update


def test_a_bench_step_short_of_memory_beside_step_graphs_drops_them_and_runs_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the training loop recovers: the graphs' pool goes and the same micro-batch runs eagerly. Without graphs
    to drop, running out of memory is the row's result."""
    import torch
    from speed_models import packed_batch, tiny_lora_model

    from engine.bench.speed import bench_adamw, train_step
    from engine.speed import SpeedController

    def replaying(function: Any) -> tuple[Any, torch.Tensor]:
        out = torch.zeros(())
        return lambda: out.copy_(function()), out

    torch.manual_seed(0)
    model = tiny_lora_model("llama")
    controller = SpeedController(model, AUTO, torch.device("cpu"))
    controller.graphs.switch(True)
    controller.graphs.capturer = lambda: replaying
    optimizer = bench_adamw(model, 1e-3, "foreach")
    for _ in range(2):  # eager, then captured and replayed
        train_step(model, controller, packed_batch((30, 20)), optimizer)
    assert controller.graphs.captured == 1
    run = controller.forward_backward
    calls: list[int] = []

    def short_once(*args: Any) -> torch.Tensor:
        calls.append(controller.graphs.captured)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 MiB")
        return run(*args)

    monkeypatch.setattr(controller, "forward_backward", short_once)
    loss = train_step(model, controller, packed_batch((30, 20)), optimizer)
    assert calls == [1, 0] and torch.isfinite(loss)
    assert "ran short" in controller.state()["step_graphs"]["reason"]
    calls.clear()
    with pytest.raises(torch.OutOfMemoryError):
        train_step(model, controller, packed_batch((30, 20)), optimizer)
    assert calls == [0]


def test_bench_processes_of_the_same_model_take_turns_instead_of_waiting_for_each_other(tmp_path: Path) -> None:
    """Two processes benching one model (say, different row lengths) are two peers, not one."""
    import subprocess
    import sys

    script = (
        "import sys; from pathlib import Path; from engine.bench.speed import timing_turn\n"
        "with timing_turn(Path(sys.argv[1]), 2, 'llama-3.1-8b'):\n"
        "    open(sys.argv[2], 'a').write('timed\\n')\n"
    )
    lock, done = tmp_path / "lock" / "timing", tmp_path / "done"
    root = Path(__file__).resolve().parents[1]
    peers = [subprocess.Popen([sys.executable, "-c", script, str(lock), str(done)], cwd=root) for _ in range(2)]
    try:
        codes = [peer.wait(timeout=HANG_S) for peer in peers]
    finally:
        for peer in peers:
            peer.kill()
    assert codes == [0, 0] and done.read_text().split() == ["timed", "timed"]


def test_the_warm_up_lasts_until_automatic_step_graphs_have_decided() -> None:
    """Timed steps never include the trial's eager runs and capture; a choice that never decides stops the warm-up
    at its limit."""
    from engine.bench.speed import settle

    events: list[str] = []
    verdict_after = 3
    steps = settle(lambda: events.append("step"), lambda: events.count("step") >= verdict_after,
                   lambda: events.append("wait"), limit=8)  # fmt: skip
    assert steps == 3 and events == ["step", "wait"] * 3
    assert settle(lambda: events.append("step"), lambda: True, lambda: None, limit=8) == 0
    events.clear()
    assert settle(lambda: events.append("step"), lambda: False, lambda: None, limit=8) == 8


def test_bench_rows_wait_for_the_step_graphs_verdict() -> None:
    from engine.bench.speed import graphs_decided

    trial = SimpleNamespace(graphs=SimpleNamespace(trial=object()))
    assert not graphs_decided(trial)
    trial.graphs.trial = None
    assert graphs_decided(trial)
