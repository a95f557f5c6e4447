"""Training methods: supervised tuning (sft), preference tuning (dpo) and learning from rewards (grpo), each one
:class:`~engine.run.methods.base.TrainingMethod` that the run's loop, session and report call; what is known of
each before a model loads (how it packs, what it refuses) is engine.method_facts."""

from __future__ import annotations

import importlib

from engine.method_facts import facts_for
from engine.run.methods.base import TrainingMethod

METHODS: dict[str, str] = {"sft": "sft:SftMethod", "dpo": "dpo:DpoMethod", "grpo": "grpo:GrpoMethod"}
"""Each method's module (in this package) and class, imported when a run asks for it: the methods build on
engine.run.step, which itself reads the methods' shared types, so nothing here imports them up front."""


def method_for(name: str) -> TrainingMethod:
    """A fresh method object for one run of ``training.method`` ``name``."""
    facts_for(name)  # an unknown name fails here, naming the known ones
    module, _, cls = METHODS[name].partition(":")
    method: type[TrainingMethod] = getattr(importlib.import_module(f"engine.run.methods.{module}"), cls)
    return method()


__all__ = ["METHODS", "TrainingMethod", "method_for"]
