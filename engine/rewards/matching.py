"""How an answer is compared with a reference: SQuAD's normalisation for text, and numbers compared as numbers.

The report's exact match and the ``reference`` reward share :func:`normalize_answer`, so "matches the reference"
means the same thing before training (the reward) and after it (the report). Normalisation alone would turn
"1,000" into "1000" but "1000.0" into "10000", so numbers are read as numbers first: "1,000", "1000" and "1000.0"
are one value, and "-3" is not "3".
"""

from __future__ import annotations

import math
import re
import string

_PUNCTUATION = frozenset(string.punctuation)
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
_WHOLE_NUMBER = re.compile(rf"\s*\$?({_NUMBER})\s*%?\s*\.?\s*")
_ANY_NUMBER = re.compile(rf"(?<![\w.,])({_NUMBER})(?![\w]|[.,]\d)")


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _value(number: str) -> float:
    return float(number.replace(",", ""))


def as_number(text: str) -> float | None:
    """The number ``text`` is, when it is one and nothing else ("1,000", " 12.5 ", "$3", "40%", "7."), else None."""
    found = _WHOLE_NUMBER.fullmatch(text)
    return _value(found.group(1)) if found else None


def numbers_in(text: str) -> list[float]:
    """Every number written in ``text``, in order ("3 apples and 1,200 pears" -> [3.0, 1200.0])."""
    return [_value(found.group(1)) for found in _ANY_NUMBER.finditer(text)]


def same_number(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def answer_equals(answer: str, reference: str) -> bool:
    """``answer`` says exactly ``reference``: the same number, or the same text once normalised."""
    expected, given = as_number(reference), as_number(answer)
    if expected is not None and given is not None:
        return same_number(expected, given)
    return normalize_answer(answer) == normalize_answer(reference)


def answer_contains(answer: str, reference: str) -> bool:
    """``answer`` says ``reference`` somewhere: a number written in it equals a numeric reference, or the
    normalised reference appears in the normalised answer as whole words ("12" is not in "120")."""
    expected = as_number(reference)
    if expected is not None:
        return any(same_number(expected, value) for value in numbers_in(answer))
    wanted = normalize_answer(reference)
    return bool(wanted) and f" {wanted} " in f" {normalize_answer(answer)} "
