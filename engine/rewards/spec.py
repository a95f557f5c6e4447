"""What a user chose as rewards (:class:`RewardSpec`), what a built reward is (:class:`Reward`), and the error both
raise (:class:`RewardError`).

A spec is plain data: a kind, a weight and settings, hashable and saved in a run's config.json through
:meth:`RewardSpec.to_json`. Building one into a callable reward (and loading a user's file) happens only in
:func:`engine.rewards.build.build_rewards`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

from engine.errors import TuneDeckError

RewardKind = Literal["regex", "reference", "json", "length", "python"]
KINDS: tuple[str, ...] = get_args(RewardKind)


class RewardError(TuneDeckError, ValueError):
    """A reward cannot be built, or one of its scores is unusable; the message names the reward (and the row)."""


def _frozen(value: object) -> object:
    """Lists (as JSON gives them) become tuples, so a spec stays hashable."""
    return tuple(_frozen(item) for item in value) if isinstance(value, list | tuple) else value


def _thawed(value: object) -> object:
    return [_thawed(item) for item in value] if isinstance(value, tuple) else value


@dataclass(frozen=True)
class RewardSpec:
    """One reward a user chose: a built-in kind with its settings, or a user's Python file."""

    kind: RewardKind
    """regex, reference, json, length, or python (a user's file with ``reward(prompt, completion, **row)``)."""
    weight: float = 1.0
    """The reward's share of the total: total = sum(weight * score); negative for a penalty."""
    settings: tuple[tuple[str, object], ...] = ()
    """The kind's settings as (name, value) pairs, kept sorted by name (e.g. (("pattern", r"^\\d+$"),))."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RewardError(f"unknown reward kind {self.kind!r}", hint=f"choose one of {', '.join(KINDS)}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float) or not math.isfinite(self.weight):
            raise RewardError(f"{self.kind} reward: the weight must be a finite number, not {self.weight!r}")
        names = [name for name, _ in self.settings]
        if len(set(names)) != len(names):
            raise RewardError(f"{self.kind} reward: a setting is given twice ({', '.join(names)})")
        object.__setattr__(self, "weight", float(self.weight))
        object.__setattr__(self, "settings", tuple(sorted((str(n), _frozen(v)) for n, v in self.settings)))

    def setting(self, name: str, default: Any = None) -> Any:
        """The value of setting ``name``, or ``default`` when it is not set."""
        return dict(self.settings).get(name, default)

    def to_json(self) -> dict[str, object]:
        return {"kind": self.kind, "weight": self.weight, "settings": {n: _thawed(v) for n, v in self.settings}}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> RewardSpec:
        settings = data.get("settings", {})
        if not isinstance(settings, Mapping):
            raise RewardError(f"a reward's settings must be an object, not {settings!r}")
        weight = data.get("weight", 1.0)
        return cls(data.get("kind"), weight, tuple(settings.items()))  # type: ignore[arg-type]


class Reward(Protocol):
    """A built reward: scores one completion of one prompt; ``row`` is the prompt's data row (its columns)."""

    name: str
    """Unique per run: the kind ("regex", "json"), "python:<file stem>", with "-2", "-3" for repeats."""
    weight: float

    def __call__(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float: ...
