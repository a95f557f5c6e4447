"""A user's own reward: a Python file defining ``reward(prompt, completion, **row) -> float``.

Where code may come from: only the path the user gives (``--reward python:PATH`` or the app's file picker), kept
in the run's config.json. TuneDeck never looks for a reward file anywhere else, never takes a path from a data
row or a column, and never runs code found in a dataset's or a model's folder unless the user named that very
file; running it is the same as running ``python PATH``, so it should be a file the user wrote or read.

The file is run once when the rewards are built; its problems are reported then, naming the file and the line:
a missing file, a syntax error or an exception while importing, no ``reward`` function, or one that cannot take
a prompt and a completion. ``row`` holds the prompt's data row without its ``prompt`` and ``completion``
columns (those are the first two arguments); a function without ``**row`` receives only the columns it names.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.rewards.spec import RewardError, RewardSpec

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _failure_line(error: BaseException, path: Path) -> str:
    """ ", line N" of the deepest frame of ``error`` inside the user's file (or of its syntax error)."""
    if isinstance(error, SyntaxError) and error.lineno is not None:
        return f", line {error.lineno}"
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if Path(frame.filename) == path]
    return f", line {lines[-1]}" if lines else ""


def load_module(path: Path) -> Any:
    """Run the file at ``path`` as a module of its own."""
    name = f"tunedeck_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RewardError(f"reward file {path}: cannot be loaded as Python", hint="give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling in the user's file look their module up here
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise RewardError(
            f"reward file {path}{_failure_line(error, path)}: {type(error).__name__}: {error}",
            hint="fix the file; it is run once when the rewards are built",
        ) from error
    return module


def check_signature(function: Callable[..., Any], path: Path) -> tuple[bool, frozenset[str]]:
    """Whether ``function`` takes ``**row``, and else the column names it takes; a clear error when it cannot be
    called as ``reward(prompt, completion, ...)``."""
    usage = "define it as: def reward(prompt, completion, **row) -> float"
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        raise RewardError(f"reward file {path}: reward has no readable signature", hint=usage) from None
    variadic = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters)
    positional = [p for p in parameters if p.kind in _POSITIONAL]
    if len(positional) < 2 and not variadic:
        raise RewardError(f"reward file {path}: reward must take a prompt and a completion", hint=usage)
    extra = [p.name for p in positional[2:] if p.default is inspect.Parameter.empty]
    if extra:
        raise RewardError(f"reward file {path}: reward's argument {extra[0]!r} has no default", hint=usage)
    keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    named = frozenset(p.name for p in parameters[2:] if p.kind is not inspect.Parameter.VAR_KEYWORD)
    return keywords, named


@dataclass
class PythonReward:
    name: str
    weight: float
    path: Path
    function: Callable[..., Any]
    takes_row: bool
    columns: frozenset[str]

    @classmethod
    def build(cls, spec: RewardSpec, name: str) -> PythonReward:
        unknown = sorted({n for n, _ in spec.settings} - {"path"})
        if unknown:
            raise RewardError(f"python reward: unknown setting {', '.join(unknown)}", hint="its one setting: path")
        given = spec.setting("path")
        if not isinstance(given, str) or not given:
            raise RewardError("python reward: needs the path of a .py file", hint="--reward python:my_reward.py")
        path = Path(given).expanduser().resolve()
        if not path.is_file():
            raise RewardError(f"reward file {path} does not exist", hint="give the path of a .py file")
        function = getattr(load_module(path), "reward", None)
        if not callable(function):
            raise RewardError(
                f"reward file {path} defines no reward function",
                hint="define: def reward(prompt, completion, **row) -> float",
            )
        takes_row, columns = check_signature(function, path)
        return cls(name, spec.weight, path, function, takes_row, columns)

    def __call__(self, prompt: str, completion: str, row: Mapping[str, Any]) -> float:
        passed = {k: v for k, v in row.items() if k not in ("prompt", "completion")}
        if not self.takes_row:
            passed = {k: v for k, v in passed.items() if k in self.columns}
        result: float = self.function(prompt, completion, **passed)
        return result
