"""Building the chosen rewards (:func:`build_rewards`) and scoring completions with them
(:func:`score_completions`), the two calls a training method makes.

A reward's score must be a finite number: an int, a float, or a bool (counted as 1 or 0, so a check such as
``return "answer:" in completion`` works as is). Anything else, NaN, an infinity, or an exception inside the
reward stops the scoring with an error naming the data row and the reward.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.rewards.builtin import JsonReward, LengthReward, ReferenceReward, RegexReward
from engine.rewards.spec import Reward, RewardError, RewardSpec
from engine.rewards.user_file import PythonReward

_BUILDERS: dict[str, Callable[[RewardSpec, str], Reward]] = {
    "regex": RegexReward.build,
    "reference": ReferenceReward.build,
    "json": JsonReward.build,
    "length": LengthReward.build,
    "python": PythonReward.build,
}


def base_name(spec: RewardSpec) -> str:
    """The reward's name before repeats are numbered: its kind, or python:<file stem>."""
    if spec.kind == "python":
        path = str(spec.setting("path", ""))
        return f"python:{path.replace(chr(92), '/').rsplit('/', 1)[-1].removesuffix('.py')}"
    return spec.kind


def reward_names(specs: Sequence[RewardSpec]) -> list[str]:
    """One unique name per spec: "regex", "regex-2", "python:check", ..."""
    seen: dict[str, int] = {}
    names = []
    for spec in specs:
        base = base_name(spec)
        seen[base] = seen.get(base, 0) + 1
        names.append(base if seen[base] == 1 else f"{base}-{seen[base]}")
    return names


def build_rewards(specs: Sequence[RewardSpec]) -> list[Reward]:
    """The rewards ``specs`` describe, their settings checked and users' files loaded (from their given paths
    only); a :class:`RewardError` naming the reward when one cannot be built."""
    if not specs:
        raise RewardError("no reward chosen", hint="add one, e.g. --reward reference or --reward 'regex:^\\d+$'")
    return [_BUILDERS[spec.kind](spec, name) for spec, name in zip(specs, reward_names(specs), strict=True)]


@dataclass(frozen=True)
class RewardScores:
    names: tuple[str, ...]
    """The rewards' names, in the order they were built."""
    per_reward: tuple[tuple[float, ...], ...]
    """per_reward[r][c]: reward r's score of completion c (before its weight)."""
    total: tuple[float, ...]
    """Each completion's weighted sum of scores."""

    def means(self) -> dict[str, float]:
        """Each reward's mean score over the completions (what a run logs per step)."""
        pairs = zip(self.names, self.per_reward, strict=True)
        return {name: sum(scores) / max(len(scores), 1) for name, scores in pairs}


def checked_score(value: object, reward: Reward, row_number: int) -> float:
    where = f"reward {reward.name} on data row {row_number}"
    if not isinstance(value, numbers.Real):
        raise RewardError(
            f"{where} returned {type(value).__name__} {value!r:.80}, not a number",
            hint="a reward returns a float (or an int or a bool)",
        )
    score = float(value)
    if not math.isfinite(score):
        raise RewardError(f"{where} returned {score}", hint="a reward's score must be a finite number")
    return score


def score_one(reward: Reward, prompt: str, completion: str, row: Mapping[str, Any], row_number: int) -> float:
    try:
        value = reward(prompt, completion, row)
    except RewardError as error:
        raise RewardError(f"reward {reward.name} on data row {row_number}: {error.message}", error.hint) from error
    except Exception as error:
        raise RewardError(
            f"reward {reward.name} raised {type(error).__name__} on data row {row_number}: {error}",
            hint=f"completion: {completion[:200]!r}",
        ) from error
    return checked_score(value, reward, row_number)


def score_completions(
    rewards: Sequence[Reward],
    prompts: Sequence[str],
    completions: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    row_numbers: Sequence[int],
) -> RewardScores:
    """Every reward's score of every completion and their weighted totals. ``prompts``, ``rows`` and
    ``row_numbers`` run beside ``completions`` (a prompt's group of completions repeats its prompt and row)."""
    if not len(prompts) == len(completions) == len(rows) == len(row_numbers):
        raise ValueError(
            f"{len(completions)} completions need as many prompts, rows and row numbers, "
            f"not {len(prompts)}, {len(rows)} and {len(row_numbers)}"
        )
    inputs = list(zip(prompts, completions, rows, row_numbers, strict=True))
    per_reward = tuple(tuple(score_one(reward, *item) for item in inputs) for reward in rewards)
    weights = [reward.weight for reward in rewards]
    by_completion = zip(*per_reward, strict=True) if per_reward else ((),) * len(inputs)
    total = tuple(math.fsum(w * s for w, s in zip(weights, scores, strict=True)) for scores in by_completion)
    return RewardScores(tuple(reward.name for reward in rewards), per_reward, total)
