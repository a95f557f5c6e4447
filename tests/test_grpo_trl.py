"""TuneDeck's GRPO against TRL's GRPOTrainer, the reference implementation: the same tiny model, starting adapter,
prompts, injected answers and rewards give the same per-step loss, KL and clip fraction, and the same advantages
for every sampling, within 1e-3 for 10 steps (float32, speed switches off): with a KL penalty and two steps on
each sampling (so the ratio moves and the clip acts), for TRL's loss variants."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dpo_reference import save_starting_adapter
from grpo_reference import (
    STEPS,
    Answers,
    engine_config,
    engine_rewards,
    engine_steps,
    equal_length_prompts,
    trl_steps,
)
from helpers import write_jsonl

from engine.run.methods import grpo

pytest.importorskip("trl", reason="TRL is the reference: install the test extra (pip install -e '.[test]')")

TOLERANCE = 1e-3
PROMPTS = 2

CASES = {
    "grpo-kl-two-steps": {"loss_type": "grpo", "beta": 0.1, "num_iterations": 2, "epsilon": 0.05},
    "dapo-two-steps": {"loss_type": "dapo", "beta": 0.0, "num_iterations": 2, "epsilon": 0.05, "temperature": 0.7},
    "dr_grpo-kl": {"loss_type": "dr_grpo", "beta": 0.05, "num_iterations": 1, "epsilon": 0.2},
}
ENGINE_NAMES = {"beta": "kl_beta"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_grpo_matches_trl_step_by_step(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    from transformers import AutoTokenizer

    settings = CASES[case]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    vocab = len(tokenizer)
    prompts = equal_length_prompts(tokenizer, PROMPTS)
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in prompts])
    # TRL's KL reference is a frozen copy of the adapter it is handed, TuneDeck's the base model (adapter off): the
    # same model from a fresh adapter, so the KL cases start from one; the case without KL from a trained one
    adapter = save_starting_adapter(tiny_model_dir, tmp_path / "start", trained=not settings["beta"])

    ours_answers, our_advantages = Answers(vocab), []
    real_advantages = grpo.group_advantages

    def recorded(rewards: torch.Tensor, group: int, scale: str) -> Any:
        result = real_advantages(rewards, group, scale)
        our_advantages.append(result[0].detach().clone())
        return result

    monkeypatch.setattr(grpo, "sample_answers", lambda model, prompts, *a, **k: ours_answers.for_prompts(
        [p for p in prompts for _ in range(a[0].group)]
    ))  # fmt: skip
    monkeypatch.setattr(grpo, "build_rewards", lambda specs: engine_rewards())
    monkeypatch.setattr(grpo, "group_advantages", recorded)
    engine_settings = {ENGINE_NAMES.get(key, key): value for key, value in settings.items()}
    config = engine_config(tiny_model_dir, data, adapter, tmp_path / "runs", PROMPTS, **engine_settings)
    ours = engine_steps(config)

    theirs, their_advantages = trl_steps(
        tiny_model_dir, data, adapter, tmp_path / "trl", PROMPTS, Answers(vocab), **settings
    )

    assert len(ours) == len(theirs) == STEPS
    samplings = STEPS // settings["num_iterations"]
    assert len(our_advantages) == len(their_advantages) == samplings
    for mine, reference in zip(our_advantages, their_advantages, strict=True):
        # the same answers in another order (TRL's sampler orders prompts its own way): compare as sorted values
        assert torch.sort(mine).values.tolist() == pytest.approx(torch.sort(reference).values.tolist(), abs=TOLERANCE)
    assert any(a.abs().max() > 0.5 for a in our_advantages), "rewards that differ within a group"
    for step, logged in zip(ours, theirs, strict=True):
        assert step.loss == pytest.approx(logged["loss"], abs=TOLERANCE), (step.step, "loss")
        assert step.clip_fraction == pytest.approx(logged["clip_ratio/region_mean"], abs=TOLERANCE), step.step
        if settings["beta"]:
            assert step.kl == pytest.approx(logged["kl"], abs=TOLERANCE), (step.step, "kl")
        else:
            assert step.kl is None
    if settings["num_iterations"] > 1:
        assert any((step.clip_fraction or 0) > 0 for step in ours), "the clip acted: a comparison that can fail"
    if settings["beta"]:
        assert any((step.kl or 0) > 1e-4 for step in ours), "the KL moved"
