r"""The command line's ``--reward`` value: ``[WEIGHT*]KIND[:ARGUMENT]``.

The weight, when given, comes first and ends with ``*``; the default is 1. For ``regex``, ``regex-full`` and
``python`` the argument is everything after the first colon, as typed, so a pattern or a path may hold ``:``,
``@``, ``,``, ``*`` or ``=``. The other kinds take options separated by ``:``.

=================================  ===========================================================================
``regex:^\d+$``                    1 when the pattern is found in the answer (re.search)
``regex-full:\d+``                 1 when the whole answer, stripped, matches (re.fullmatch)
``reference``                      the answer equals the row's ``answer`` (or ``reference``) column
``reference:contains``             the answer contains it (``equals`` is the default)
``reference:contains:column=gold`` ... of column ``gold``
``json``                           the answer is a JSON object (a lone fenced block counts)
``json:keys=name,age``             ... with keys ``name`` and ``age``; add ``:fenced=no`` to refuse fences
``length:20-200``                  20 to 200 characters (partial credit outside); ``20-`` or ``-200`` for one
``length:5-40:words``              5 to 40 words
``python:path/to/file.py``         the file's ``reward(prompt, completion, **row)``
``0.5*regex:^\d+$``                weight 0.5 (``-1*length:-300`` is a penalty)
=================================  ===========================================================================

Quote the value in a shell: ``--reward '0.5*regex:^\d+$'``.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.rewards.build import build_rewards
from engine.rewards.spec import KINDS, RewardError, RewardSpec

USAGE = (
    r"--reward [WEIGHT*]KIND[:ARGUMENT], e.g. 'regex:^\d+$', 'regex-full:\d+', reference, reference:contains, "
    "'json:keys=name,age', length:20-200, length:5-40:words, python:my_reward.py, '0.5*regex:^\\d+$'"
)
_WEIGHT = re.compile(r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\*(?=[a-z])")
_WINDOW = re.compile(r"(\d*)-(\d*)")
_YES, _NO = ("yes", "true", "on", "1"), ("no", "false", "off", "0")


def _error(text: str, problem: str) -> RewardError:
    return RewardError(f"--reward {text!r}: {problem}", hint=USAGE)


def _split_options(text: str, rest: str) -> dict[str, str]:
    """``a=1:b=2`` -> {"a": "1", "b": "2"}; a bare word maps to itself under the key ""."""
    options: dict[str, str] = {}
    for part in filter(None, rest.split(":")):
        key, _, value = part.partition("=") if "=" in part else ("", "", part)
        if key in options and key:
            raise _error(text, f"{key} is given twice")
        options[key.strip() if key else f"#{len(options)}"] = value.strip()
    return options


def _reference(text: str, options: dict[str, str]) -> dict[str, object]:
    settings: dict[str, object] = {}
    for key, value in options.items():
        if key.startswith("#") and value in ("equals", "contains"):
            settings["mode"] = value
        elif key in ("mode", "column"):
            settings[key] = value
        else:
            raise _error(
                text, f"reference takes equals, contains or column=NAME, not {value if key[0] == '#' else key}"
            )
    return settings


def _json(text: str, options: dict[str, str]) -> dict[str, object]:
    settings: dict[str, object] = {}
    for key, value in options.items():
        if key == "keys":
            settings["keys"] = tuple(k.strip() for k in value.split(",") if k.strip())
        elif key == "fenced" and value.lower() in _YES + _NO:
            settings["fenced"] = value.lower() in _YES
        else:
            raise _error(text, f"json takes keys=A,B and fenced=yes|no, not {value if key[0] == '#' else key}")
    return settings


def _length(text: str, options: dict[str, str]) -> dict[str, object]:
    settings: dict[str, object] = {}
    for key, value in options.items():
        window = _WINDOW.fullmatch(value) if key.startswith("#") else None
        if window:
            low, high = window.groups()
            settings.update({"min": int(low)} if low else {})
            settings.update({"max": int(high)} if high else {})
        elif key.startswith("#") and value in ("chars", "words"):
            settings["unit"] = value
        elif key in ("min", "max") and value.isdigit():
            settings[key] = int(value)
        elif key == "unit":
            settings[key] = value
        else:
            raise _error(text, f"length takes MIN-MAX, chars or words, not {value if key[0] == '#' else key}")
    return settings


def parse_reward_flag(text: str) -> RewardSpec:
    """The reward ``text`` describes (see the module's table); a :class:`RewardError` with the usage otherwise.
    Settings are checked here too (a bad regular expression fails now); a python file is loaded only when the
    rewards are built."""
    start = text.lstrip()  # a pattern's or a path's own trailing spaces are kept
    weight_match = _WEIGHT.match(start)
    body = start[weight_match.end() :] if weight_match else start
    weight = float(weight_match.group(1)) if weight_match else 1.0
    name, _, rest = body.partition(":")
    name = name.strip()
    if name in ("regex", "regex-full", "python") and not rest:
        raise _error(text, f"{name} needs an argument after ':'")
    if name == "regex" or name == "regex-full":
        settings: dict[str, object] = {"pattern": rest}
        settings.update({"match": "full"} if name == "regex-full" else {})
    elif name == "python":
        settings = {"path": str(Path(rest).expanduser().resolve())}  # a resumed run finds it from any folder
    elif name in ("reference", "json", "length"):
        parse = {"reference": _reference, "json": _json, "length": _length}[name]
        settings = parse(text, _split_options(text, rest))
    else:
        raise _error(text, f"unknown reward {name!r}; the kinds are {', '.join(KINDS)}")
    spec = RewardSpec("regex" if name == "regex-full" else name, weight, tuple(settings.items()))  # type: ignore[arg-type]
    if spec.kind != "python":
        try:
            build_rewards([spec])
        except RewardError as error:
            raise _error(text, error.message) from None
    return spec


def format_reward_flag(spec: RewardSpec) -> str:
    """The ``--reward`` text that parses back to ``spec`` (the app shows it beside the command it would run)."""
    weight = "" if spec.weight == 1.0 else f"{spec.weight!r}*"
    if spec.kind == "regex":
        kind = "regex-full" if spec.setting("match") == "full" else "regex"
        return f"{weight}{kind}:{spec.setting('pattern', '')}"
    if spec.kind == "python":
        return f"{weight}python:{spec.setting('path', '')}"
    parts: list[str] = [spec.kind]
    if spec.kind == "length" and ("min" in dict(spec.settings) or "max" in dict(spec.settings)):
        parts.append(f"{spec.setting('min', '')}-{spec.setting('max', '')}")
    for key, value in spec.settings:
        if spec.kind == "length" and key in ("min", "max"):
            continue
        if isinstance(value, tuple):
            value = ",".join(map(str, value))
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        parts.append(f"{key}={value}")
    return weight + ":".join(parts)
