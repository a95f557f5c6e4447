"""Out-of-memory recovery for picture runs: a step that runs short is retried once as it was, then trained in
smaller micro-batches, then with the recompute on; the update is the same, the run says so in its events and its
memory log, and when nothing is left it stops with the finished steps saved and resumes from them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from test_vision_train import colour_rows, config
from vision_models import build_vision_model

from engine.events import CheckpointSaved, OomRecovered, RunFailed, RunFinished, SpeedRestored, StepMetrics
from engine.run import guard, vision_loop
from engine.run.vision_guard import split_padded
from engine.train import run


@pytest.fixture(scope="module")
def idefics(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vision_model(tmp_path_factory.mktemp("idefics3"), "idefics3")


def test_a_micro_batch_splits_into_padded_groups_within_the_budget() -> None:
    assert split_padded([10, 10, 12, 12], 48) == [[0, 1, 2, 3]]
    assert split_padded([10, 10, 12, 12], 24) == [[0, 1], [2, 3]]
    assert split_padded([10, 11, 30], 20) == [[0], [1], [2]]  # padded to 11: two do not fit; 30 stands alone


def short_of_memory(
    monkeypatch: pytest.MonkeyPatch, steps: set[int], more_than: int, times: int
) -> tuple[list[int], list[tuple[int, int, bool]]]:
    """Training forwards of ``steps`` holding more than ``more_than`` examples run out of memory, ``times`` times in
    all. Returns the steps that ran short and (step, examples, recompute on) of every training forward."""
    real = vision_loop.loss_sum
    short: list[int] = []
    forwards: list[tuple[int, int, bool]] = []
    step = {"now": 0}
    real_step = vision_loop.train_step

    def counting_step(session: Any) -> Any:
        step["now"] = session.step + 1
        return (yield from real_step(session))

    def fault(model: Any, processor: Any, examples: Sequence[Any], *rest: Any) -> Any:
        if model.training:
            forwards.append((step["now"], len(examples), bool(model.base_model.model.is_gradient_checkpointing)))
            if step["now"] in steps and len(examples) > more_than and len(short) < times:
                short.append(step["now"])
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, processor, examples, *rest)

    monkeypatch.setattr(vision_loop, "loss_sum", fault)
    monkeypatch.setattr(vision_loop, "train_step", counting_step)
    return short, forwards


def losses(events: list[Any]) -> list[float]:
    return [e.loss for e in events if isinstance(e, StepMetrics)]


def memory_log(run_dir: Path) -> list[tuple[str, str]]:
    lines = (run_dir / "memory.jsonl").read_text().splitlines()
    return [(record["kind"], record["action"]) for record in map(json.loads, lines)]


def test_a_step_short_of_memory_trains_smaller_micro_batches_then_climbs_back(
    idefics: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = colour_rows(tmp_path)
    reference = list(run(config(idefics, data, tmp_path / "ref", max_steps=5)))
    assert len(losses(reference)) == 5
    monkeypatch.setattr(guard, "CLIMB_AFTER", 2)
    short, forwards = short_of_memory(monkeypatch, steps={2}, more_than=2, times=2)
    events = list(run(config(idefics, data, tmp_path / "oom", max_steps=5)))
    assert [e for e in events if isinstance(e, RunFinished)], [e for e in events if isinstance(e, RunFailed)]
    assert short == [2, 2]
    lowered = [(e.step, e.action) for e in events if isinstance(e, OomRecovered)]
    assert lowered == [(2, "retry"), (2, "tokens_per_batch")]
    (restored,) = [e for e in events if isinstance(e, SpeedRestored)]
    assert restored.step == 4 and "padded tokens again" in restored.message
    finished = {step: examples for step, examples, _ in forwards}  # the last forward of each step
    assert finished == {1: 4, 2: 2, 3: 2, 4: 4, 5: 4}  # four examples a micro-batch, two while short
    assert losses(events) == pytest.approx(losses(reference), rel=1e-4)  # the same updates
    assert memory_log(tmp_path / "oom" / "vision") == [
        ("OomRecovered", "retry"),
        ("OomRecovered", "tokens_per_batch"),
        ("SpeedRestored", "tokens_per_batch"),
    ]


def test_a_step_that_cannot_fit_stops_with_its_finished_steps_saved_and_resumes(
    idefics: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = colour_rows(tmp_path)
    reference = losses(list(run(config(idefics, data, tmp_path / "ref", max_steps=3))))
    short, forwards = short_of_memory(monkeypatch, steps={2}, more_than=0, times=99)
    events = list(run(config(idefics, data, tmp_path / "oom", max_steps=3)))
    actions = [e.action for e in events if isinstance(e, OomRecovered)]
    assert actions == ["retry", "tokens_per_batch", "tokens_per_batch", "recompute"]
    assert len(short) == 5  # twice whole, once in halves, once one by one, once recomputed: then it stops
    assert {n for s, n, _ in forwards if s == 2} == {4, 2, 1} and (2, 1, True) in forwards
    (failed,) = [e for e in events if isinstance(e, RunFailed)]
    assert "out of GPU memory at step 2" in failed.message and "1 finished steps are saved" in failed.message
    assert "vision.max_pixels" in (failed.hint or "")
    (saved,) = [e for e in events if isinstance(e, CheckpointSaved)]
    assert saved.step == 1
    monkeypatch.undo()
    events = list(run(config(idefics, data, tmp_path / "oom", max_steps=3), resume=tmp_path / "oom" / "vision"))
    assert [e for e in events if isinstance(e, RunFinished)], [e for e in events if isinstance(e, RunFailed)]
    assert [e.step for e in events if isinstance(e, StepMetrics)] == [2, 3]
    assert losses(events) == pytest.approx(reference[1:], rel=1e-4)  # step 2 trains as if nothing had happened
