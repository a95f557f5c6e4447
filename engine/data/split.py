"""Which examples a run holds out, chosen with the run's seed; torch-free, so that an export can ask the installed
model one of the run's own held-out questions instead of one about something else."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from engine.config import held_out_count
from engine.data.files import Conversation, Example, Message, PreferencePair


def split_examples(examples: Sequence[Any], fraction: float | None, seed: int) -> tuple[list[Any], list[Any]]:
    """(training, held-out) examples, the held-out ones chosen with the run's seed: ``fraction`` of them, or (None)
    the automatic count."""
    n_eval = held_out_count(len(examples)) if fraction is None else max(1, round(len(examples) * fraction))
    if (fraction is not None and fraction <= 0) or len(examples) < 2 or n_eval == 0:
        return list(examples), []
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    held_out = set(order[:n_eval])
    train = [ex for i, ex in enumerate(examples) if i not in held_out]
    return train, [examples[i] for i in sorted(held_out)]


def first_question(example: Example) -> str:
    """What the user asks first in ``example`` ("" for raw text, which asks nothing)."""
    turns: Sequence[Message] = ()
    if isinstance(example, Conversation):
        turns = example.messages
    elif isinstance(example, PreferencePair):
        if not example.is_chat:
            return str(example.prompt).strip()
        turns = example.prompt  # type: ignore[assignment]
    else:
        return example.prompt.strip()
    return next((turn.content.strip() for turn in turns if turn.role == "user" and turn.content.strip()), "")
