"""Out-of-memory recovery that climbs back: the same settings are retried once, then one setting is lowered, and
it is tried again after enough good steps with memory to spare (engine.run.guard.Recovery)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import resident_room
from test_reliability import assert_same_curve, curve, failures, make_config, wrap_forward

from engine.events import OomRecovered, SpeedChanged, SpeedRestored, StepMetrics
from engine.run import guard
from engine.train import run

GIB = 2**30


def test_a_steps_first_shortage_is_retried_once_with_the_same_settings() -> None:
    recovery = guard.Recovery()
    assert recovery.retry_first(3) and not recovery.retry_first(3)
    assert recovery.retry_first(4)  # a new step gets its own retry


@pytest.mark.parametrize(
    ("good_steps", "peak_gib", "usable_gib", "due"),
    [
        (4, 5.0, 8.0, False),  # too soon
        (5, 5.0, 8.0, True),
        (5, 7.5, 8.0, False),  # the steps since came within the margin of the card
        (5, 7.5, None, True),  # no usable figure (the CPU): steps alone decide
    ],
)
def test_a_lowered_setting_is_due_after_good_steps_with_a_memory_margin(
    good_steps: int, peak_gib: float, usable_gib: float | None, due: bool
) -> None:
    recovery = guard.Recovery(climb_after=5, margin=0.1)
    recovery.lowered_now(guard.STEP_GRAPHS, step=2)
    for _ in range(good_steps):
        recovery.good_step(int(peak_gib * GIB))
    usable = None if usable_gib is None else int(usable_gib * GIB)
    assert (recovery.due(usable) is not None) is due


def test_the_most_recent_lowering_is_undone_first_one_at_a_time() -> None:
    recovery = guard.Recovery(climb_after=2)
    recovery.lowered_now(guard.STEP_GRAPHS, step=2)
    recovery.lowered_now(guard.TOKENS_PER_BATCH, step=2, previous=4096)
    recovery.good_step(0), recovery.good_step(0)
    last = recovery.due(None)
    assert last == guard.Lowered(guard.TOKENS_PER_BATCH, 2, 4096) and "4096 tokens" in last.describe()
    recovery.climbed_back(last)
    assert recovery.due(None) is None  # the next waits its own good steps
    recovery.good_step(0), recovery.good_step(0)
    assert recovery.due(None) == guard.Lowered(guard.STEP_GRAPHS, 2)


def test_a_climb_that_runs_short_again_waits_twice_as_long_then_stays_down() -> None:
    recovery = guard.Recovery(climb_after=2, max_climbs=2)
    waits = []
    for step in range(3):
        recovery.lowered_now(guard.STEP_GRAPHS, step)
        waits.append(recovery.wait_for(guard.STEP_GRAPHS))
        while (due := recovery.due(None)) is None and recovery.wait_for(guard.STEP_GRAPHS) is not None:
            recovery.good_step(0)
        if due is not None:
            recovery.climbed_back(due)
    assert waits == [2, 4, None]
    assert recovery.due(None) is None and recovery.lowered == [guard.Lowered(guard.STEP_GRAPHS, 2)]


def test_a_climb_that_held_for_its_steps_is_not_counted_as_failed_later() -> None:
    recovery = guard.Recovery(climb_after=2)
    recovery.lowered_now(guard.STEP_GRAPHS, 1)
    recovery.good_step(0), recovery.good_step(0)
    recovery.climbed_back(recovery.lowered[-1])
    recovery.good_step(0), recovery.good_step(0)  # proven
    recovery.lowered_now(guard.STEP_GRAPHS, 9)
    assert recovery.wait_for(guard.STEP_GRAPHS) == 2


def test_switches_the_user_sets_replace_what_a_shortage_lowered() -> None:
    recovery = guard.Recovery(climb_after=1)
    recovery.lowered_now(guard.TOKENS_PER_BATCH, 1, previous=128)
    recovery.lowered_now(guard.CHUNKED_MLP, 1, previous=None)
    recovery.forget({guard.CHUNKED_MLP})
    assert [entry.kind for entry in recovery.lowered] == [guard.TOKENS_PER_BATCH]


def short_at(
    step: int, above_tokens: int, times: int, budgets: list[tuple[int, int]] | None = None
) -> tuple[Callable, list[int]]:
    """Out of memory in training forwards of ``step`` with more than ``above_tokens`` tokens, ``times`` times;
    ``budgets`` collects (step, micro-batch budget) of every training forward."""
    calls: list[int] = []

    def fault(session, batch, num_items, real):
        if session.model.training and budgets is not None:
            budgets.append((session.step + 1, session.tokens_per_batch))
        short = session.model.training and session.step + 1 == step and batch.num_tokens > above_tokens
        if short and len(calls) < times:
            calls.append(session.step + 1)
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {batch.num_tokens} MiB")
        return real(session, batch, num_items)

    return fault, calls


def test_a_passing_shortage_costs_one_retry_and_nothing_else(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed = {"tokens_per_batch": 128}
    reference = list(run(make_config(tiny_model_dir, chat_file, tmp_path / "ref", packed)))
    assert not failures(reference)
    fault, calls = short_at(step=2, above_tokens=0, times=1)
    wrap_forward(monkeypatch, fault)
    events = list(run(make_config(tiny_model_dir, chat_file, tmp_path / "oom", packed)))
    assert not failures(events), failures(events)
    assert calls == [2]
    assert [(e.step, e.action) for e in events if isinstance(e, OomRecovered)] == [(2, "retry")]
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [1, 2, 3, 4, 5, 6]
    assert_same_curve(curve(tmp_path / "oom" / "run"), curve(tmp_path / "ref" / "run"), rel=1e-5)


def test_a_lowered_micro_batch_climbs_back_after_good_steps(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 2 runs short twice: its rows train in 64-token pieces; two good steps later the run goes back to
    128-token micro-batches, says so in its events and its memory log, and its losses equal the run that never
    ran short (splitting a row changes no update)."""
    monkeypatch.setattr(guard, "CLIMB_AFTER", 2)
    packed = {"tokens_per_batch": 128}
    assert not failures(list(run(make_config(tiny_model_dir, chat_file, tmp_path / "ref", packed))))
    sizes: list[tuple[int, int]] = []
    fault, calls = short_at(step=2, above_tokens=0, times=2, budgets=sizes)
    wrap_forward(monkeypatch, fault)
    events = list(run(make_config(tiny_model_dir, chat_file, tmp_path / "oom", packed)))
    assert not failures(events), failures(events)
    assert calls == [2, 2]
    lowered = [(e.step, e.action, e.tokens_per_batch) for e in events if isinstance(e, OomRecovered)]
    assert lowered == [(2, "retry", 128), (2, "tokens_per_batch", 64)]
    (restored,) = [e for e in events if isinstance(e, SpeedRestored)]
    assert (restored.step, restored.action) == (4, "tokens_per_batch") and "128 tokens" in restored.message
    budgets = dict(sizes)  # the budget each step finished with
    assert budgets[3] == 64 and budgets[4] == 128 and budgets[6] == 128
    assert_same_curve(curve(tmp_path / "oom" / "run"), curve(tmp_path / "ref" / "run"), rel=1e-5)
    log = [json.loads(line) for line in (tmp_path / "oom" / "run" / "memory.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["action"]) for r in log] == [
        ("OomRecovered", "retry"),
        ("OomRecovered", "tokens_per_batch"),
        ("SpeedRestored", "tokens_per_batch"),
    ]


def test_a_switch_given_up_for_memory_comes_back_after_good_steps(
    tiny_model_dir: Path, chat_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resident layers run short twice at step 1: every layer recomputes for two steps, then the layers are
    resident again and the state says so."""
    import dataclasses

    monkeypatch.setattr(guard, "CLIMB_AFTER", 2)
    resident_room(monkeypatch, from_start=True)  # as if a GPU had room for one layer
    calls: list[int] = []

    def fault(session, batch, num_items, real):
        if session.model.training and session.speed.resident_layers and session.step == 0 and len(calls) < 2:
            calls.append(session.step + 1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 MiB")
        return real(session, batch, num_items)

    wrap_forward(monkeypatch, fault)
    config = make_config(tiny_model_dir, chat_file, tmp_path, {"tokens_per_batch": 48})
    config = dataclasses.replace(config, speed=dataclasses.replace(config.speed, checkpointing="offloaded"))
    events = list(run(config))
    assert not failures(events), failures(events)
    assert [e.action for e in events if isinstance(e, OomRecovered)] == ["retry", "resident_layers"]
    assert [(e.step, e.action) for e in events if isinstance(e, SpeedRestored)] == [(3, "resident_layers")]
    resident = [(e.step, e.state["resident_layers"]["on"]) for e in events if isinstance(e, SpeedChanged)]
    assert (0, False) in resident and resident[-1] == (2, True)  # announced after step 2, for step 3 on
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [1, 2, 3, 4, 5, 6]
