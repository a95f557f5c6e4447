"""Training methods: supervised tuning (sft), preference tuning (dpo) and learning from rewards (grpo), each one
:class:`~engine.run.methods.base.TrainingMethod` that the run's loop, session and report call; what is known of
each before a model loads (how it packs, what it refuses) is engine.method_facts."""

from __future__ import annotations

from engine.method_facts import facts_for
from engine.run.methods.base import TrainingMethod
from engine.run.methods.dpo import DpoMethod
from engine.run.methods.grpo import GrpoMethod
from engine.run.methods.sft import SftMethod

METHODS: dict[str, type[TrainingMethod]] = {"sft": SftMethod, "dpo": DpoMethod, "grpo": GrpoMethod}


def method_for(name: str) -> TrainingMethod:
    """A fresh method object for one run of ``training.method`` ``name``."""
    facts_for(name)  # an unknown name fails here, naming the known ones
    return METHODS[name]()


__all__ = ["METHODS", "TrainingMethod", "method_for"]
