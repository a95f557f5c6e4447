"""Rewards: each built-in on a table of answers, weights and totals, the --reward syntax, a user's reward file and
every way it can be wrong, and the errors scoring raises (naming the row and the reward)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hang import HANG_S
from hypothesis import given
from hypothesis import strategies as st

from engine.rewards import (
    RewardError,
    RewardSpec,
    build_rewards,
    format_reward_flag,
    parse_reward_flag,
    score_completions,
)
from engine.run.short_answers import exact_match


def score(flag: str, completion: str, row: dict[str, Any] | None = None, prompt: str = "Q?") -> float:
    (reward,) = build_rewards([parse_reward_flag(flag)])
    return reward(prompt, completion, row or {})


@pytest.mark.parametrize(
    ("flag", "completion", "expected"),
    [
        (r"regex:\d+", "it is 42", 1.0),
        (r"regex:^\d+$", "it is 42", 0.0),
        (r"regex-full:\d+", "  42\n", 1.0),
        (r"regex-full:\d+", "42 apples", 0.0),
        (r"regex:<answer>.*</answer>", "<answer>x</answer>", 1.0),
        ("regex:a:b@c,d", "xx a:b@c,d yy", 1.0),
        ("json", '{"a": 1}', 1.0),
        ("json", "[1, 2]", 0.0),
        ("json", "not json", 0.0),
        ("json:keys=name,age", '{"name": "x", "age": 3}', 1.0),
        ("json:keys=name,age", '{"name": "x"}', 0.0),
        ("json", '```json\n{"a": 1}\n```', 1.0),
        ("json", '```\n{"a": 1}\n```\n', 1.0),
        ("json:fenced=no", '```json\n{"a": 1}\n```', 0.0),
        ("json", 'Here it is: ```json\n{"a": 1}\n```', 0.0),
        ("length:5-10", "abcdefg", 1.0),
        ("length:5-10", "abcdefghij", 1.0),
        ("length:5-10", "ab", 0.4),
        ("length:5-10", "", 0.0),
        ("length:5-10", "a" * 15, 0.5),
        ("length:5-10", "a" * 25, 0.0),
        ("length:2-3:words", "one two three", 1.0),
        ("length:2-3:words", "one", 0.5),
        ("length:-4", "abcdef", 0.5),
        ("length:4-", "a" * 1000, 1.0),
    ],
)
def test_builtin_scores(flag: str, completion: str, expected: float) -> None:
    assert score(flag, completion) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("flag", "completion", "reference", "expected"),
    [
        ("reference", "Paris", "paris", 1.0),
        ("reference", "The Paris.", "Paris", 1.0),
        ("reference", "Paris, France", "Paris", 0.0),
        ("reference:contains", "Paris, France", "Paris", 1.0),
        ("reference:contains", "Parisian", "Paris", 0.0),
        ("reference", "1,000", "1000.0", 1.0),
        ("reference", "1000", "1,000", 1.0),
        ("reference", "$12.50", "12.5", 1.0),
        ("reference", "-3", "3", 0.0),
        ("reference", "100", "1000", 0.0),
        ("reference:contains", "So the answer is 1,000.", "1000", 1.0),
        ("reference:contains", "So the answer is 120.", "12", 0.0),
        ("reference:contains", "3 + 4 = 7", "7.0", 1.0),
        ("reference", "7", 7, 1.0),
        ("reference", "blue", ["red", "Blue"], 1.0),
        ("reference", "green", ["red", "Blue"], 0.0),
    ],
)
def test_reference_scores(flag: str, completion: str, reference: object, expected: float) -> None:
    assert score(flag, completion, {"answer": reference}) == expected


def test_reference_matches_the_reports_exact_match_on_text() -> None:
    pairs = [("The cat!", "cat"), ("a dog", "Dog."), ("two words", "two  Words"), ("no", "yes")]
    for completion, reference in pairs:
        assert score("reference", completion, {"answer": reference}) == exact_match(completion, reference)


def test_reference_column_choice() -> None:
    assert score("reference", "x", {"reference": "x"}) == 1.0
    assert score("reference", "x", {"answer": "x", "reference": "y"}) == 1.0
    assert score("reference:column=gold", "x", {"answer": "y", "gold": "x"}) == 1.0
    with pytest.raises(RewardError, match="no 'gold' column"):
        score("reference:column=gold", "x", {"answer": "x"})
    with pytest.raises(RewardError, match="'answer' or 'reference'"):
        score("reference", "x", {"prompt": "q"})


@pytest.mark.parametrize(
    ("flag", "spec"),
    [
        (r"regex:^\d+$", RewardSpec("regex", 1.0, (("pattern", r"^\d+$"),))),
        (r"regex-full:\d+", RewardSpec("regex", 1.0, (("pattern", r"\d+"), ("match", "full")))),
        (r"0.5*regex:^\d+$", RewardSpec("regex", 0.5, (("pattern", r"^\d+$"),))),
        ("2*regex:a*b:c@d,e=f", RewardSpec("regex", 2.0, (("pattern", "a*b:c@d,e=f"),))),
        ("regex:3*x", RewardSpec("regex", 1.0, (("pattern", "3*x"),))),
        ("reference", RewardSpec("reference")),
        ("reference:contains", RewardSpec("reference", settings=(("mode", "contains"),))),
        ("reference:equals:column=gold", RewardSpec("reference", settings=(("mode", "equals"), ("column", "gold")))),
        ("json:keys=name,age", RewardSpec("json", settings=(("keys", ("name", "age")),))),
        ("json:fenced=no", RewardSpec("json", settings=(("fenced", False),))),
        ("length:20-200", RewardSpec("length", settings=(("min", 20), ("max", 200)))),
        ("length:5-40:words", RewardSpec("length", settings=(("min", 5), ("max", 40), ("unit", "words")))),
        ("-1*length:-300", RewardSpec("length", -1.0, (("max", 300),))),
        ("1e-1*json", RewardSpec("json", 0.1)),
    ],
)
def test_flag_grammar(flag: str, spec: RewardSpec) -> None:
    parsed = parse_reward_flag(flag)
    assert parsed == spec
    assert parse_reward_flag(format_reward_flag(parsed)) == parsed


def test_python_flag_keeps_the_path_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec = parse_reward_flag("0.25*python:sub/my:file.py")
    assert spec == RewardSpec("python", 0.25, (("path", str(tmp_path / "sub" / "my:file.py")),))


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("regex:(", "not a valid regular expression"),
        ("regex:", "needs an argument"),
        ("python:", "needs an argument"),
        ("words", "unknown reward 'words'"),
        ("2*", "unknown reward"),
        ("reference:sometimes", "not sometimes"),
        ("json:keys", "json takes"),
        ("json:fenced=maybe", "json takes"),
        ("length:200-20", "below min"),
        ("length:0-0", "above 0"),
        ("length:abc", "length takes"),
        ("length:5-10:lines", "length takes"),
        ("length:unit=lines", "unit must be one of"),
    ],
)
def test_flag_errors(flag: str, message: str) -> None:
    with pytest.raises(RewardError, match=message) as raised:
        parse_reward_flag(flag)
    assert raised.value.hint


@given(
    weight=st.floats(-100, 100, allow_nan=False).filter(lambda w: w != 0),
    pattern=st.text(st.characters(codec="ascii", exclude_characters="\n\\()[]{}?+*|^$."), min_size=1),
)
def test_any_regex_text_and_weight_round_trip(weight: float, pattern: str) -> None:
    spec = RewardSpec("regex", weight, (("pattern", pattern),))
    assert parse_reward_flag(format_reward_flag(spec)) == spec


@given(
    st.lists(
        st.sampled_from(["regex:x", "reference:contains", "json:keys=a", "length:1-9:words", "3*json"]),
        min_size=1,
        max_size=4,
    )
)
def test_specs_survive_config_json(flags: list[str]) -> None:
    specs = [parse_reward_flag(f) for f in flags]
    saved = json.loads(json.dumps([s.to_json() for s in specs]))
    assert [RewardSpec.from_json(d) for d in saved] == specs
    assert len({hash(s) for s in specs}) == len(set(specs))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (lambda: RewardSpec("bleu"), "unknown reward kind"),  # type: ignore[arg-type]
        (lambda: RewardSpec("json", math.nan), "finite number"),
        (lambda: RewardSpec("json", True), "finite number"),
        (lambda: RewardSpec("json", 1.0, (("keys", ("a",)), ("keys", ("b",)))), "given twice"),
        (lambda: build_rewards([RewardSpec("json", settings=(("key", "a"),))]), "unknown setting key"),
        (lambda: build_rewards([RewardSpec("regex")]), "needs a pattern"),
        (lambda: build_rewards([RewardSpec("length", settings=(("min", -1),))]), "whole numbers"),
        (lambda: build_rewards([]), "no reward chosen"),
        (lambda: RewardSpec.from_json({"kind": "json", "settings": [1]}), "must be an object"),
    ],
)
def test_spec_errors(spec: Any, message: str) -> None:
    with pytest.raises(RewardError, match=message):
        spec()


# --- weights and scoring ------------------------------------------------------------------------------------------


def test_weights_names_and_totals() -> None:
    specs = [parse_reward_flag(f) for f in (r"regex:\d", r"0.5*regex:^a", "-2*length:-3", "reference:contains")]
    rewards = build_rewards(specs)
    assert [r.name for r in rewards] == ["regex", "regex-2", "length", "reference"]
    completions = ["a1", "b", "a 42 x"]
    rows = [{"answer": "42"}] * 3
    scores = score_completions(rewards, ["q"] * 3, completions, rows, [7, 7, 7])
    assert scores.per_reward == ((1.0, 0.0, 1.0), (1.0, 0.0, 1.0), (1.0, 1.0, 0.0), (0.0, 0.0, 1.0))
    assert scores.total == pytest.approx((-0.5, -2.0, 2.5))
    assert scores.means() == pytest.approx({"regex": 2 / 3, "regex-2": 2 / 3, "length": 2 / 3, "reference": 1 / 3})


def test_mismatched_lengths_are_refused() -> None:
    rewards = build_rewards([RewardSpec("json")])
    with pytest.raises(ValueError, match="as many prompts"):
        score_completions(rewards, ["q"], ["a", "b"], [{}, {}], [1, 2])


# --- a user's reward file -----------------------------------------------------------------------------------------


def reward_file(tmp_path: Path, body: str, name: str = "check.py") -> RewardSpec:
    path = tmp_path / name
    path.write_text(body, encoding="utf-8")
    return RewardSpec("python", 2.0, (("path", str(path)),))


def test_user_reward_gets_prompt_completion_and_row(tmp_path: Path) -> None:
    spec = reward_file(
        tmp_path,
        "def reward(prompt, completion, **row):\n"
        "    assert 'prompt' not in row and 'completion' not in row\n"
        "    return float(completion.endswith(row['answer'])) + len(prompt) / 100\n",
    )
    (reward,) = build_rewards([spec])
    assert reward.name == "python:check" and reward.weight == 2.0
    scores = score_completions([reward], ["ab"], ["so 5"], [{"prompt": "ab", "answer": "5"}], [3])
    assert scores.per_reward == ((1.02,),) and scores.total == (2.04,)


def test_user_reward_without_row_gets_the_columns_it_names(tmp_path: Path) -> None:
    spec = reward_file(tmp_path, "def reward(prompt, completion, answer=''):\n    return completion == answer\n")
    (reward,) = build_rewards([spec])
    assert reward("q", "x", {"answer": "x", "other": 1}) is True


def test_user_rewards_with_the_same_stem_get_unique_names(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    body = "def reward(prompt, completion, **row):\n    return 1\n"
    rewards = build_rewards([reward_file(tmp_path, body, "r.py"), reward_file(tmp_path, body, "b/r.py")])
    assert [r.name for r in rewards] == ["python:r", "python:r-2"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("x = 1\n", "defines no reward function"),
        ("reward = 3\n", "defines no reward function"),
        ("def reward(prompt):\n    return 1\n", "must take a prompt and a completion"),
        ("def reward(prompt, completion, extra):\n    return 1\n", "'extra' has no default"),
        ("import os\n\ndef reward(prompt, completion:\n    return 1\n", r"check\.py, line 3: SyntaxError"),
        ("import os\nimport not_a_module_anywhere_xyz\n", r"check\.py, line 2: ModuleNotFoundError"),
        ("def helper():\n    return 1 / 0\n\nhelper()\n", r"check\.py, line 2: ZeroDivisionError"),
    ],
)
def test_user_reward_file_errors(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(RewardError, match=message) as raised:
        build_rewards([reward_file(tmp_path, body)])
    assert str(tmp_path / "check.py") in str(raised.value)


def test_missing_user_file(tmp_path: Path) -> None:
    with pytest.raises(RewardError, match="does not exist"):
        build_rewards([RewardSpec("python", settings=(("path", str(tmp_path / "nope.py")),))])


def test_user_file_is_not_run_when_the_flag_is_parsed(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "side.py"
    path.write_text(f"open({str(marker)!r}, 'w').close()\ndef reward(p, c, **row):\n    return 0\n")
    spec = parse_reward_flag(f"python:{path}")
    assert not marker.exists()
    build_rewards([spec])
    assert marker.exists()


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ("'yes'", "returned str 'yes', not a number"),
        ("None", "returned NoneType None, not a number"),
        ("float('nan')", "returned nan"),
        ("float('inf')", "returned inf"),
        ("1 / 0", "raised ZeroDivisionError on data row 11"),
        ("row['missing']", "raised KeyError on data row 11"),
    ],
)
def test_bad_scores_name_the_row_and_the_reward(tmp_path: Path, returned: str, message: str) -> None:
    rewards = build_rewards(
        [RewardSpec("json"), reward_file(tmp_path, f"def reward(prompt, completion, **row):\n    return {returned}\n")]
    )
    with pytest.raises(RewardError, match=message) as raised:
        score_completions(rewards, ["q", "q"], ["{}", "x"], [{}, {}], [11, 12])
    assert "python:check" in str(raised.value) and "row 1" in str(raised.value)


@pytest.mark.parametrize(("returned", "expected"), [("True", 1.0), ("False", 0.0), ("3", 3.0), ("-0.5", -0.5)])
def test_bools_and_ints_count_as_numbers(tmp_path: Path, returned: str, expected: float) -> None:
    rewards = build_rewards([reward_file(tmp_path, f"def reward(prompt, completion, **row):\n    return {returned}\n")])
    assert score_completions(rewards, ["q"], ["c"], [{}], [1]).per_reward == ((expected,),)


def test_a_builtin_reward_error_names_the_row() -> None:
    rewards = build_rewards([RewardSpec("reference")])
    with pytest.raises(RewardError, match="reward reference on data row 5: the row has no"):
        score_completions(rewards, ["q"], ["c"], [{"prompt": "q"}], [5])


def test_rewards_load_without_torch() -> None:
    """The command line parses --reward before it loads torch."""
    code = "import sys, engine.rewards\nassert 'torch' not in sys.modules, 'torch imported'\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S)
    assert result.returncode == 0, result.stderr
