"""A CPU run's time before its first step comes from a timed training pass of a row as long as its own, and the pass
changes nothing about the training that follows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train import finish, losses, make_config

from engine.events import RunStarted
from engine.run import cpu_pace
from engine.run.estimate import cpu_run_seconds
from engine.train import run


def test_a_timed_pass_leaves_no_gradient_and_the_random_state_as_it_was(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).train()
    before = torch.random.get_rng_state()
    seconds = cpu_pace.training_pass_seconds(model, 48, model.config.vocab_size)
    assert seconds > 0
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(parameter.grad is None for parameter in model.parameters())


def test_the_time_said_before_the_first_step_is_the_timed_pass_scaled_to_the_run(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_pace, "training_pass_seconds", lambda model, tokens, vocab: 0.5)
    events = finish(run(make_config(tiny_model_dir, chat_file, tmp_path, device="cpu", keep_knowledge=False)))
    started = next(e for e in events if isinstance(e, RunStarted))
    config = make_config(tiny_model_dir, chat_file, tmp_path)
    assert started.estimate_basis == "from a timed training pass on this CPU"
    eval_rows = started.eval_examples  # one example a row at this row length
    expected = cpu_run_seconds(0.5, started.total_steps, 1, eval_rows, config.training.eval_every or 0)
    assert started.estimated_s == pytest.approx(expected, rel=0.5)  # held-out rows pack a few examples to a row


def test_a_run_too_slow_to_time_says_the_planners_figure(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_pace, "MEASURE_UP_TO_S", 0.0)
    events = finish(run(make_config(tiny_model_dir, chat_file, tmp_path, device="cpu", keep_knowledge=False)))
    started = next(e for e in events if isinstance(e, RunStarted))
    assert started.estimate_basis == "from the planner's figure for this CPU" and started.estimated_s


def test_the_timed_pass_leaves_the_training_as_it_was(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed = finish(run(make_config(tiny_model_dir, chat_file, tmp_path / "timed", device="cpu")))
    monkeypatch.setattr(cpu_pace, "MEASURE_UP_TO_S", 0.0)  # every row too slow to time
    untimed = finish(run(make_config(tiny_model_dir, chat_file, tmp_path / "untimed", device="cpu")))
    bases = [next(e for e in events if isinstance(e, RunStarted)).estimate_basis for events in (timed, untimed)]
    assert bases == ["from a timed training pass on this CPU", "from the planner's figure for this CPU"]
    assert losses(tmp_path / "timed" / "run") == losses(tmp_path / "untimed" / "run")
