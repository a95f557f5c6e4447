"""The automatic settings a run's data chooses (engine.hardware.fit_to_data): a table of datasets, models and
methods against hand-worked figures, and the rule that an explicit setting always wins."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import RunConfig, held_out_count
from engine.hardware.fit_to_data import FitFacts, apply_fit, fit_to_data

SMOL = 134_515_008  # SmolLM2-135M
EIGHT_B = 8_030_261_248


def facts(examples: int, tokens_each: int = 50, **changes: object) -> FitFacts:
    base = FitFacts(
        examples=examples,
        tokens=examples * tokens_each,
        separate_held_out=False,
        parameters=SMOL,
        instruct=True,
        method="sft",
        tokens_per_batch=400,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


# examples -> held out (hand-worked: 12%, at least 8, at most 200, none under 16)
@pytest.mark.parametrize(
    ("examples", "held_out"), [(10, 0), (15, 0), (16, 8), (60, 8), (70, 8), (100, 12), (1000, 120), (5000, 200)]
)
def test_the_held_out_split_is_large_enough_to_choose_on_and_capped(examples: int, held_out: int) -> None:
    assert held_out_count(examples) == held_out
    assert fit_to_data(facts(examples)).held_out == held_out


# (examples, tokens each, tokens per batch) -> (steps, passes), worked by hand:
# 70 examples: 62 train + 31 replay = 93 rows of 50 tokens; 93 * 50 / 400 / 0.9 = 12.9 -> 13 rows; 8 passes -> 104.
# 1000 examples: 880 train, replay 192 (a small set: under 2,000) -> 1072 * 50 / 360
#   = 148.9 -> 149 rows; 480 / 880 = 0.55 -> 1 pass -> 149 steps.
# 20 examples: 12 train + 16 replay = 28 * 50 / 360 = 3.9 -> 4 rows; 8 passes = 32 steps.
# 5 examples: no held-out, 5 train + 16 replay = 21 * 50 / 360 = 2.9 -> 3 rows; 8 passes = 24 -> at least 30.
# 200,000 examples of 500 tokens: one pass of 199,800 / (400 * 0.9) * 500 rows, capped at 3,000.
@pytest.mark.parametrize(
    ("examples", "tokens_each", "steps", "epochs"),
    [(70, 50, 104, 8.0), (1000, 50, 149, 1.0), (20, 50, 32, 8.0), (5, 50, 30, 8.0), (200_000, 500, 3000, 1.0)],
)
def test_a_small_set_gets_several_passes_a_large_one_one_capped_pass(
    examples: int, tokens_each: int, steps: int, epochs: float
) -> None:
    fit = fit_to_data(facts(examples, tokens_each))
    assert (fit.max_steps, fit.epochs) == (steps, epochs)


def test_evaluations_come_about_fifteen_times_a_run_and_early_stopping_needs_them() -> None:
    fit = fit_to_data(facts(70))
    assert fit.eval_every == 7  # ceil(104 / 15)
    assert fit.early_stop == 4
    tiny = fit_to_data(facts(10))
    assert (tiny.held_out, tiny.eval_every, tiny.early_stop) == (0, 0, 0)
    separate = fit_to_data(facts(10, separate_held_out=True))
    assert separate.held_out == 0 and separate.eval_every > 0 and separate.early_stop == 4


@pytest.mark.parametrize(
    ("parameters", "method", "rate"),
    [(SMOL, "sft", 3e-4), (1_500_000_000, "sft", 2e-4), (EIGHT_B, "sft", 2e-4), (70e9, "sft", 1e-4),
     (SMOL, "dpo", 7.5e-5), (None, "sft", 2e-4)],
)  # fmt: skip
def test_the_learning_rate_follows_the_model_size_and_method(parameters: int | None, method: str, rate: float) -> None:
    assert fit_to_data(facts(500, parameters=parameters, method=method)).learning_rate == pytest.approx(rate)


@pytest.mark.parametrize(
    ("examples", "parameters", "rank"), [(70, SMOL, 8), (1000, SMOL, 16), (50_000, SMOL, 16), (50_000, EIGHT_B, 32)]
)
def test_the_adapter_is_small_for_a_small_set_and_large_for_large_sets_of_large_models(
    examples: int, parameters: int, rank: int
) -> None:
    fit = fit_to_data(facts(examples, parameters=parameters))
    assert (fit.lora_rank, fit.lora_alpha) == (rank, 2.0 * rank)


@pytest.mark.parametrize(
    ("examples", "instruct", "method", "replay"),
    [(70, True, "sft", 31), (20, True, "sft", 16), (1000, True, "sft", 192), (3000, True, "sft", 0),
     (70, False, "sft", 0), (70, True, "dpo", 0)],
)  # fmt: skip
def test_knowledge_is_kept_for_small_sets_of_instruction_tuned_models(
    examples: int, instruct: bool, method: str, replay: int
) -> None:
    fit = fit_to_data(facts(examples, instruct=instruct, method=method))
    assert (fit.keep_knowledge, fit.replay_examples) == (replay > 0, replay)


def test_every_choice_says_why() -> None:
    reasons = dict(fit_to_data(facts(70)).reasons)
    assert reasons["held out"] == "8 of 70 examples, enough to choose the best adapter on"
    assert reasons["steps"].startswith("104: 8 passes over 62 examples")
    assert "0.13B" in reasons["learning rate"]
    assert reasons["keep knowledge"].startswith("on: 31 of the base model's own answers")


def test_automatic_settings_are_filled_and_explicit_ones_win() -> None:
    fit = fit_to_data(facts(70))
    automatic, lines = apply_fit(RunConfig(), fit)
    assert automatic.data.eval_fraction == pytest.approx(8 / 70)
    assert (automatic.training.max_steps, automatic.training.eval_every, automatic.training.early_stop) == (104, 7, 4)
    assert automatic.training.learning_rate == pytest.approx(3e-4) and automatic.training.warmup_steps == 5
    assert (automatic.lora.rank, automatic.lora.alpha, automatic.training.keep_knowledge) == (8, 16.0, True)
    assert len(lines) == 7
    explicit = RunConfig.from_dict(
        {
            "data": {"eval_fraction": 0.2},
            "training": {"epochs": 2.0, "learning_rate": 1e-3, "eval_every": 5, "early_stop": 0, "warmup_steps": 2,
                         "keep_knowledge": False},
            "lora": {"rank": 32},
        }
    )  # fmt: skip
    kept, lines = apply_fit(explicit, fit)
    assert kept.data.eval_fraction == 0.2 and kept.training.epochs == 2.0 and kept.training.max_steps == 0
    assert (kept.training.learning_rate, kept.training.eval_every, kept.training.early_stop) == (1e-3, 5, 0)
    assert kept.training.warmup_steps == 2 and kept.training.keep_knowledge is False
    assert (kept.lora.rank, kept.lora.alpha) == (32, 64.0)  # alpha left automatic follows the rank given
    assert lines == []


def test_explicit_steps_keep_their_length_and_evaluations_follow_them() -> None:
    config = RunConfig.from_dict({"training": {"max_steps": 300}})
    resolved, _ = apply_fit(config, fit_to_data(facts(70)))
    assert (
        resolved.training.max_steps == 300
        and resolved.training.eval_every == 20
        and resolved.training.warmup_steps == 15
    )


def test_nothing_held_out_means_no_evaluations_and_no_early_stop() -> None:
    config = RunConfig.from_dict({"data": {"eval_fraction": 0.0}})
    resolved, lines = apply_fit(config, fit_to_data(facts(70)))
    assert (resolved.training.eval_every, resolved.training.early_stop) == (0, 0)
    assert "early stop: off (nothing held out)" in lines


def test_passes_the_user_gave_set_the_evaluations_by_their_own_steps() -> None:
    # 70 examples: 13 rows a pass (see above); 2 passes are 26 steps: an evaluation every 2, warm-up 1
    resolved, _ = apply_fit(RunConfig.from_dict({"training": {"epochs": 2.0}}), fit_to_data(facts(70)))
    assert resolved.training.max_steps == 0 and resolved.training.epochs == 2.0
    assert (resolved.training.eval_every, resolved.training.warmup_steps) == (2, 1)
