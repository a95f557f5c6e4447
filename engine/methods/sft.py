"""Supervised tuning: learn the answers of the examples. Its steps and evaluation are the packed documents' loss
(engine.run.step), the path every speed switch was built for; it refuses none."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.methods.base import HeldOut, StepTokens, TrainingMethod
from engine.methods.facts import FACTS

if TYPE_CHECKING:
    import torch

    from engine.run.session import Session


class SftMethod(TrainingMethod):
    facts = FACTS["sft"]

    def accumulate(self, session: Session, rows: list[int]) -> tuple[torch.Tensor, StepTokens]:
        from engine.run.step import accumulate_documents

        return accumulate_documents(session, rows)

    def evaluate(self, session: Session) -> HeldOut | None:
        from engine.run.step import evaluate_documents

        result = evaluate_documents(session)
        return None if result is None else HeldOut(*result)
