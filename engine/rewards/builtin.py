"""The built-in rewards. Each scores one completion between 0 and 1 and is built from a :class:`RewardSpec`'s
settings, which it checks when built (a bad regular expression fails before any training, not at step 1).

- ``regex``: 1 when the completion matches ``pattern``, else 0. ``match="search"`` (default) finds it anywhere;
  ``match="full"`` needs the whole completion, stripped of surrounding whitespace, to match.
- ``reference``: 1 when the completion says the row's reference answer, else 0, compared as the report's exact
  match compares (SQuAD normalisation; numbers as numbers, "1,000" == "1000.0"). ``mode="equals"`` (default): the
  whole completion is the answer; ``mode="contains"``: the answer appears in it as whole words (or, for a number,
  as one of the numbers written in it). ``column`` names the reference column; unset, it is ``answer`` or else
  ``reference``. A list in that column holds several accepted answers.
- ``json``: 1 when the completion is one JSON object holding every key in ``keys``, else 0. With ``fenced=True``
  (default) a completion that is only a fenced block (```json ... ``` or ``` ... ```) counts too, since chat
  models write JSON that way; text before or after the object or fence scores 0.
- ``length``: 1 when the completion's length in ``unit`` ("chars", default, or "words") is within
  [``min``, ``max``]; outside, partial credit falling linearly to 0 (at length 0 below the window, at twice
  ``max`` above it), so a group of answers that are all too long still has a gradient toward the window.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.rewards.matching import answer_contains, answer_equals
from engine.rewards.spec import RewardError, RewardSpec

DEFAULT_REFERENCE_COLUMNS = ("answer", "reference")
_FENCE = re.compile(r"\s*```[ \t]*(?:json)?[ \t]*\n(.*?)\n?[ \t]*```\s*", re.DOTALL | re.IGNORECASE)


def check_settings(spec: RewardSpec, known: set[str]) -> None:
    unknown = sorted({name for name, _ in spec.settings} - known)
    if unknown:
        raise RewardError(
            f"{spec.kind} reward: unknown setting {', '.join(unknown)}",
            hint=f"its settings: {', '.join(sorted(known))}",
        )


def choice(spec: RewardSpec, name: str, options: tuple[str, ...]) -> str:
    value = spec.setting(name, options[0])
    if value not in options:
        raise RewardError(f"{spec.kind} reward: {name} must be one of {', '.join(options)}, not {value!r}")
    return str(value)


@dataclass
class RegexReward:
    name: str
    weight: float
    pattern: re.Pattern[str]
    full: bool

    @classmethod
    def build(cls, spec: RewardSpec, name: str) -> RegexReward:
        check_settings(spec, {"pattern", "match"})
        pattern = spec.setting("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise RewardError("regex reward: needs a pattern", hint=r"e.g. --reward 'regex:^\d+$'")
        try:
            compiled = re.compile(pattern)
        except re.error as error:
            raise RewardError(f"regex reward: {pattern!r} is not a valid regular expression: {error}") from None
        return cls(name, spec.weight, compiled, choice(spec, "match", ("search", "full")) == "full")

    def __call__(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        if self.full:
            return float(self.pattern.fullmatch(completion.strip()) is not None)
        return float(self.pattern.search(completion) is not None)


@dataclass
class ReferenceReward:
    name: str
    weight: float
    column: str | None
    contains: bool

    @classmethod
    def build(cls, spec: RewardSpec, name: str) -> ReferenceReward:
        check_settings(spec, {"mode", "column"})
        column = spec.setting("column")
        if column is not None and (not isinstance(column, str) or not column):
            raise RewardError(f"reference reward: column must be a column name, not {column!r}")
        return cls(name, spec.weight, column, choice(spec, "mode", ("equals", "contains")) == "contains")

    def references(self, row: Mapping[str, Any]) -> list[str]:
        names = (self.column,) if self.column else DEFAULT_REFERENCE_COLUMNS
        found = next((row[n] for n in names if n in row and row[n] is not None), None)
        if found is None:
            raise RewardError(
                f"the row has no {' or '.join(repr(n) for n in names)} column to compare with",
                hint=f"its columns: {', '.join(map(str, row)) or 'none'}; choose one with column=NAME",
            )
        return [str(item) for item in found] if isinstance(found, list | tuple) else [str(found)]

    def __call__(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        says = answer_contains if self.contains else answer_equals
        return float(any(says(completion, reference) for reference in self.references(row)))


@dataclass
class JsonReward:
    name: str
    weight: float
    keys: tuple[str, ...]
    fenced: bool

    @classmethod
    def build(cls, spec: RewardSpec, name: str) -> JsonReward:
        check_settings(spec, {"keys", "fenced"})
        keys = spec.setting("keys", ())
        keys = (keys,) if isinstance(keys, str) else keys
        if not isinstance(keys, tuple) or not all(isinstance(k, str) and k for k in keys):
            raise RewardError(f"json reward: keys must be key names, not {keys!r}")
        fenced = spec.setting("fenced", True)
        if not isinstance(fenced, bool):
            raise RewardError(f"json reward: fenced must be true or false, not {fenced!r}")
        return cls(name, spec.weight, keys, fenced)

    def __call__(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        fence = _FENCE.fullmatch(completion) if self.fenced else None
        try:
            value = json.loads(fence.group(1) if fence else completion)
        except ValueError:
            return 0.0
        return float(isinstance(value, dict) and all(key in value for key in self.keys))


@dataclass
class LengthReward:
    name: str
    weight: float
    low: int
    high: int | None
    words: bool

    @classmethod
    def build(cls, spec: RewardSpec, name: str) -> LengthReward:
        check_settings(spec, {"min", "max", "unit"})
        low, high = spec.setting("min", 0), spec.setting("max")
        for bound in (low, high):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
                raise RewardError(f"length reward: min and max must be whole numbers >= 0, not {bound!r}")
        if high is not None and high < low:
            raise RewardError(f"length reward: max ({high}) is below min ({low})")
        if high == 0:
            raise RewardError("length reward: max must be above 0")
        return cls(name, spec.weight, low, high, choice(spec, "unit", ("chars", "words")) == "words")

    def __call__(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        size = len(completion.split()) if self.words else len(completion.strip())
        if size < self.low:
            return size / self.low
        if self.high is not None and size > self.high:
            return max(0.0, 1.0 - (size - self.high) / self.high)
        return 1.0
