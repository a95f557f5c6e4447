"""Keeping knowledge: the base model's own answers to general prompts join a small set's training rows, once, and a
resumed run packs the same rows."""

from __future__ import annotations

import json
from pathlib import Path

from engine.config import RunConfig
from engine.demo import DEMO_EVAL_FILE
from engine.events import RunStarted
from engine.run.replay import REPLAY_FILE, chosen_prompts, replay_prompts
from engine.train import run


def config(tmp_path: Path, keep: bool, steps: int = 2) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"name": "demo"},
            "data": {"path": str(DEMO_EVAL_FILE), "eval_fraction": 0.0},
            "training": {"max_steps": steps, "keep_knowledge": keep, "save_every": 1},
            "output": {"dir": str(tmp_path / "runs"), "name": "keep" if keep else "plain"},
        }
    )


def started(events: list[object]) -> RunStarted:
    return next(e for e in events if isinstance(e, RunStarted))


def test_the_base_models_answers_join_the_training_rows_and_are_kept_for_a_resume(tmp_path: Path) -> None:
    plain = started(list(run(config(tmp_path, keep=False))))
    kept = started(list(run(config(tmp_path, keep=True))))
    replay = Path(kept.run_dir) / REPLAY_FILE
    rows = [json.loads(line) for line in replay.read_text().splitlines()]
    prompts = set(replay_prompts())
    assert rows and all(row["prompt"] in prompts and row["answer"] for row in rows)
    # one replay example for every two training examples (100 of them: 50), from those that ended in time
    assert kept.train_examples == plain.train_examples + min(50, len(rows))
    resumed = started(list(run(config(tmp_path, keep=True, steps=3), resume=kept.run_dir)))
    assert resumed.train_examples == kept.train_examples and replay.read_text().splitlines() == [
        json.dumps(row) for row in rows
    ]


def test_the_prompts_are_chosen_by_the_seed() -> None:
    assert chosen_prompts(10, 1) == chosen_prompts(10, 1) != chosen_prompts(10, 2)
    assert len(chosen_prompts(10_000, 1)) == len(replay_prompts())


def test_no_replay_prompt_is_a_knowledge_check_question() -> None:
    from engine.run.knowledge import load_questions

    asked = {q.question.strip().lower() for q in load_questions()}
    assert not asked & {prompt.strip().lower() for prompt in replay_prompts()}
