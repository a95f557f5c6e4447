"""TuneDeck's DPO against TRL's DPOTrainer, the reference implementation: the same tiny model, starting adapter and
pairs in the same steps give the same per-step loss, rewards and reward accuracy within 1e-3 for 10 steps (float32,
speed switches off), for text pairs and chat pairs, from a fresh adapter and from a trained one. Both measure against
the model as it starts: TRL through a frozen copy of the starting adapter, TuneDeck through log-probabilities scored
before its first step (the base model's, kept as pairs are first met, from a fresh adapter). The second pass over
the data uses TuneDeck's kept reference log-probabilities, which TRL recomputes, so the cache is held to TRL's numbers
too."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from dpo_reference import (
    REWARD_KEYS,
    STEPS,
    engine_batches,
    engine_config,
    engine_steps,
    preference_rows,
    save_starting_adapter,
    trl_steps,
)
from helpers import write_jsonl

from engine.config import SpeedConfig

pytest.importorskip("trl", reason="TRL is the reference: install the test extra (pip install -e '.[test]')")

TOLERANCE = 1e-3


@pytest.mark.parametrize("trained", [False, True], ids=["fresh-adapter", "trained-adapter"])
@pytest.mark.parametrize(("chat", "tokens"), [(False, 192), (True, 256)], ids=["text", "chat"])
def test_dpo_matches_trl_step_by_step(
    tiny_model_dir: Path, tmp_path: Path, chat: bool, tokens: int, trained: bool
) -> None:
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(chat))
    adapter = save_starting_adapter(tiny_model_dir, tmp_path / "start", trained)
    config = engine_config(tiny_model_dir, data, adapter, tmp_path / "runs", SpeedConfig.stock(), tokens, device="cpu")
    batches, pairs = engine_batches(config)
    assert len(pairs) == len(preference_rows(chat)), "every pair is kept"
    assert len({len(batch) for batch in batches}) > 1 and len({tuple(b) for b in batches}) < STEPS, (
        "rows of several sizes, and a second pass over the data (kept reference log-probabilities)"
    )

    ours = engine_steps(config)
    theirs, tokenized = trl_steps(tiny_model_dir, data, adapter, tmp_path / "trl", batches)

    for pair, row in zip(pairs, tokenized, strict=True):  # the same tokens learned from the same context
        chosen, rejected = pair.documents()
        assert list(chosen.input_ids) == row["prompt_ids"] + row["chosen_ids"]
        assert list(rejected.input_ids) == row["prompt_ids"] + row["rejected_ids"]
        assert sum(label != -100 for label in chosen.labels) == len(row["chosen_ids"])
    assert len(ours) == len(theirs) == STEPS
    assert any(abs(step.reward_margin or 0.0) > 0.05 for step in ours), "the rewards moved: a comparison that can fail"
    assert ours[0].reward_margin == pytest.approx(0.0, abs=1e-6), "the first step is measured against itself"
    assert ours[0].loss == pytest.approx(math.log(2), abs=1e-6)
    for step, logged in zip(ours, theirs, strict=True):
        assert step.loss == pytest.approx(logged["loss"], abs=TOLERANCE), step.step
        for field, key in REWARD_KEYS.items():
            assert getattr(step, field) == pytest.approx(logged[key], abs=TOLERANCE), (step.step, field)
