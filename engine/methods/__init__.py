"""Training methods: supervised tuning (sft), preference tuning (dpo) and reinforcement from rewards (grpo), each
one :class:`~engine.methods.base.TrainingMethod` that the run's loop, session and report call. This package and
its ``facts`` import without torch; the methods themselves load on :func:`method_for`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.methods.facts import FACTS, SWITCHES, MethodFacts, facts_for

if TYPE_CHECKING:
    from engine.methods.base import TrainingMethod


def method_for(name: str) -> TrainingMethod:
    """A fresh method object for one run of ``training.method`` ``name``."""
    facts_for(name)  # an unknown name fails here, with the known ones
    if name == "dpo":
        from engine.methods.dpo import DpoMethod

        return DpoMethod()
    from engine.methods.sft import SftMethod

    return SftMethod()


__all__ = ["FACTS", "SWITCHES", "MethodFacts", "facts_for", "method_for"]
