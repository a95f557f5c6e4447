"""Trying rewards before training: the base model's greedy answers to the dataset's first prompts, each scored by
every reward; bad data and bad rewards fail before the model loads."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_jsonl

from engine.errors import DataError
from engine.rewards import RewardError, build_rewards, parse_reward_flag, score_completions
from engine.run.reward_trial import prompt_messages, trial_prompts, try_rewards

FLAGS = (r"regex:\d", "0.5*length:5-40", "reference:contains")


def prompt_file(tmp_path: Path) -> Path:
    rows: list[object] = [
        {"prompt": "add 2 and 3", "answer": "5"},
        {"text": "not a prompt row"},
        {"messages": [{"role": "user", "content": "say 7"}], "answer": "7"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}], "answer": "x"},
        {"prompt": "count to 4", "answer": "4"},
        {"prompt": "what is 1+1", "answer": "2"},
        {"prompt": "never reached", "answer": "0"},
    ]
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


@pytest.mark.parametrize(
    ("row", "messages"),
    [
        ({"prompt": "q"}, ({"role": "user", "content": "q"},)),
        ({"prompt": "  "}, None),
        ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}, 2),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, None),
        ({"messages": []}, None),
        ({"text": "t"}, None),
    ],
)
def test_prompt_messages(row: dict[str, object], messages: object) -> None:
    found = prompt_messages(row)
    assert (len(found) if isinstance(messages, int) and found else found) == messages


def test_trial_prompts_skip_rows_that_are_not_prompts(tmp_path: Path) -> None:
    from engine.data.files import read_rows

    prompts = trial_prompts(read_rows(prompt_file(tmp_path)))
    assert [p.row_number for p in prompts] == [1, 3, 5, 6]
    assert [p.prompt for p in prompts] == ["add 2 and 3", "say 7", "count to 4", "what is 1+1"]
    with pytest.raises(DataError, match="no prompt rows"):
        trial_prompts([{"text": "a"}])


def test_trial_answers_and_scores_on_a_tiny_model(tmp_path: Path, tiny_model_dir: Path) -> None:
    specs = [parse_reward_flag(flag) for flag in FLAGS]
    data = prompt_file(tmp_path)
    trial = try_rewards(str(tiny_model_dir), str(data), specs, device="cpu")
    assert [p.row_number for p in trial.prompts] == [1, 3, 5, 6]
    assert len(trial.answers) == 4 and all(isinstance(a, str) for a in trial.answers)
    assert trial.scores.names == ("regex", "length", "reference")
    again = score_completions(
        build_rewards(specs),
        [p.prompt for p in trial.prompts],
        list(trial.answers),
        [p.row for p in trial.prompts],
        [p.row_number for p in trial.prompts],
    )
    assert again == trial.scores
    assert try_rewards(str(tiny_model_dir), str(data), specs, device="cpu").answers == trial.answers  # greedy


def test_a_bad_reward_fails_before_the_model_loads(tmp_path: Path) -> None:
    with pytest.raises(RewardError, match="does not exist"):
        try_rewards("no-such-model", str(prompt_file(tmp_path)), [parse_reward_flag(f"python:{tmp_path}/x.py")])
    with pytest.raises(DataError, match="no prompt rows"):
        text_only = write_jsonl(tmp_path / "t.jsonl", [{"text": "a"}])
        try_rewards("no-such-model", str(text_only), [parse_reward_flag("json")])
