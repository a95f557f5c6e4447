"""Reading each step's loss and gradient norm one step late: the same run as reading them at once, skips included."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_reliability import adapter_is_finite, failures, poison_training_calls, wrap_forward
from test_train import finish, losses, make_config

from engine.events import CheckpointSaved, EvalMetrics, Notice, RunFinished, StepMetrics, StepSkipped
from engine.run import checkpoint as ckpt
from engine.run import readout
from engine.run.control import RunControl
from engine.run.schedule import lr_lambda
from engine.train import run


def adamw(fused: bool, params: list[torch.nn.Parameter] | None = None) -> torch.optim.AdamW:
    params = params or [torch.nn.Parameter(torch.ones(3))]
    return torch.optim.AdamW(params, lr=0.1, fused=fused or None)


@pytest.mark.parametrize(
    ("choice", "fused", "distributed", "scaled", "late", "words"),
    [
        ("auto", True, False, False, True, "automatic"),
        ("late", True, False, False, True, "as asked"),
        ("immediate", True, False, False, False, "as asked"),
        ("auto", False, False, False, False, "foreach AdamW"),
        ("late", False, False, False, False, "foreach AdamW"),
        ("auto", True, True, False, False, "several processes"),
        ("auto", True, False, True, False, "float16 loss scaling"),
    ],
)
def test_late_readout_where_the_optimizer_can_skip_on_the_device(
    choice: str, fused: bool, distributed: bool, scaled: bool, late: bool, words: str
) -> None:
    got, reason = readout.resolve(choice, adamw(fused), distributed, scaled)
    assert got is late and words in reason


def grads_for(params: list[torch.nn.Parameter], values: list[torch.Tensor]) -> None:
    for param, value in zip(params, values, strict=True):
        param.grad = value.clone()


def test_a_finite_step_updates_as_clip_then_step() -> None:
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(4, 3, generator=generator), torch.randn(5, generator=generator)]
    grads = [3 * torch.randn(p.shape, generator=generator) for p in start]
    mine = [torch.nn.Parameter(p.clone()) for p in start]
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    grads_for(mine, grads)
    grads_for(theirs, grads)
    values = readout.update_on_device(adamw(True, mine), mine, torch.tensor(2.5), 1.0)
    norm = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    adamw(True, theirs).step()
    assert values.tolist() == pytest.approx([2.5, float(norm), 0.0])
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert float((mine[0] - start[0]).abs().max()) > 0.05  # it moved


@pytest.mark.parametrize("bad", ["loss", "gradient"])
def test_a_non_finite_step_leaves_weights_moments_and_step_count(bad: str) -> None:
    params = [torch.nn.Parameter(torch.ones(4))]
    optimizer = adamw(True, params)
    grads_for(params, [torch.full((4,), 0.5)])
    readout.update_on_device(optimizer, params, torch.tensor(1.0), 1.0)  # one good step first
    before = {k: v.clone() for k, v in optimizer.state[params[0]].items()}
    weight = params[0].detach().clone()
    grads_for(params, [torch.tensor([1.0, math.inf, 0.0, 1.0]) if bad == "gradient" else torch.ones(4)])
    loss = torch.tensor(math.nan if bad == "loss" else 1.0)
    loss_value, _, skipped = readout.update_on_device(optimizer, params, loss, 1.0).tolist()
    assert skipped == 1.0 and (math.isnan(loss_value) if bad == "loss" else loss_value == 1.0)
    torch.testing.assert_close(params[0].detach(), weight, rtol=0, atol=0)
    for key, value in optimizer.state[params[0]].items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    assert not hasattr(optimizer, "found_inf")  # later steps are not skipped by a stale flag


def test_rewinding_the_schedule_gives_back_one_notch() -> None:
    optimizer = adamw(True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda("cosine", 2, 10))
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    after_two = 0.1 * lr_lambda("cosine", 2, 10)(2)
    readout.rewind_schedule(scheduler)
    assert scheduler.last_epoch == 2
    assert scheduler.get_last_lr()[0] == pytest.approx(after_two)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(after_two)


def test_a_late_run_equals_a_run_read_at_once(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    """Same losses, gradient norms, evaluations, checkpoints and adapter; both with the fused AdamW."""
    runs = {}
    for mode in ("late", "immediate"):
        config = make_config(tiny_model_dir, chat_file, tmp_path / mode, optimizer="fused", step_readout=mode)
        runs[mode] = finish(run(config))
    late, immediate = runs["late"], runs["immediate"]
    for kind in (StepMetrics, EvalMetrics, CheckpointSaved):
        assert [e.step for e in late if isinstance(e, kind)] == [e.step for e in immediate if isinstance(e, kind)]
    norms = [[e.grad_norm for e in events if isinstance(e, StepMetrics)] for events in (late, immediate)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)
    evals = [[e.loss for e in events if isinstance(e, EvalMetrics)] for events in (late, immediate)]
    assert evals[0] == pytest.approx(evals[1], rel=1e-6)
    late_dir, immediate_dir = (tmp_path / mode / "run" for mode in ("late", "immediate"))
    assert [v for _, v in losses(late_dir)] == pytest.approx([v for _, v in losses(immediate_dir)], rel=1e-6)
    from safetensors.torch import load_file

    adapters = [load_file(d / "adapter" / "adapter_model.safetensors") for d in (late_dir, immediate_dir)]
    for name, weight in adapters[0].items():
        torch.testing.assert_close(weight, adapters[1][name], rtol=1e-5, atol=1e-6)
    steps = [e for e in late if isinstance(e, StepMetrics)]
    assert all(e.step_time_s > 0 and e.tokens_per_s > 0 and e.memory_bytes > 0 for e in steps)
    assert [e.epoch for e in steps] == [e.epoch for e in immediate if isinstance(e, StepMetrics)]


def test_a_late_skip_is_reported_and_the_run_still_makes_every_step(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrap_forward(monkeypatch, poison_training_calls(lambda n: n == 2))  # step 2 is in flight when step 3 is queued
    config = make_config(tiny_model_dir, chat_file, tmp_path, optimizer="fused", step_readout="late", eval_every=0)
    events = list(run(config))
    assert not failures(events), failures(events)
    (skipped,) = [e for e in events if isinstance(e, StepSkipped)]
    assert (skipped.step, skipped.consecutive, math.isnan(skipped.loss)) == (2, 1, True)
    steps = [e for e in events if isinstance(e, StepMetrics)]
    assert [s.step for s in steps] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(s.loss) and math.isfinite(s.grad_norm) for s in steps)
    assert adapter_is_finite(tmp_path / "run")
    # the schedule was put back: the last step ran at the rate of good step 6, as in a run without the skip
    multiplier = lr_lambda("cosine", 1, 6)
    assert steps[-1].learning_rate == pytest.approx(5e-3 * multiplier(5))
    state = ckpt.load_trainer_state(ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")[-1])
    assert state.step == 6


def test_late_skips_in_a_row_stop_the_run_and_keep_the_last_checkpoint(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrap_forward(monkeypatch, poison_training_calls(lambda n: n >= 5))
    config = make_config(tiny_model_dir, chat_file, tmp_path, optimizer="fused", step_readout="late", max_bad_steps=3)
    events = list(run(config))
    assert [e.consecutive for e in events if isinstance(e, StepSkipped)] == [1, 2, 3]
    (failed,) = failures(events)
    assert "3 steps in a row from step 5" in failed.message and "step-000004" in failed.message
    saved = ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [p.name for p in saved] == ["step-000002", "step-000004"]
    assert all(ckpt.checkpoint_problem(p) is None for p in saved)


def test_a_stop_reads_the_step_in_flight_and_saves_it(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    control = RunControl()
    config = make_config(
        tiny_model_dir, chat_file, tmp_path, optimizer="fused", step_readout="late", save_every=0, eval_every=0
    )
    events = []
    for event in run(config, control=control):
        events.append(event)
        if isinstance(event, StepMetrics) and event.step == 2:
            control.stop()  # step 3 is already queued on the device
    finished = events[-1]
    assert isinstance(finished, RunFinished) and finished.cancelled and finished.step == 3
    assert [s for s, _ in losses(tmp_path / "run")] == [1, 2, 3]
    (saved,) = [e for e in events if isinstance(e, CheckpointSaved)]
    assert saved.step == 3 and ckpt.load_trainer_state(Path(saved.path)).step == 3


def test_asking_late_with_the_foreach_adamw_says_why_not(tiny_model_dir: Path, chat_file: Path, tmp_path: Path) -> None:
    config = make_config(tiny_model_dir, chat_file, tmp_path, optimizer="foreach", step_readout="late", max_steps=1)
    notices = [e.message for e in finish(run(config)) if isinstance(e, Notice)]
    assert any("step readout" in m and "foreach AdamW" in m for m in notices), notices
