"""Learning-rate schedules: linear warm-up, then cosine, linear or constant, as LambdaLR multipliers."""

from __future__ import annotations

import math
from collections.abc import Callable


def lr_lambda(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The multiplier of the peak learning rate at each step (0-based, before that step's update)."""

    def multiplier(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if kind == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier
