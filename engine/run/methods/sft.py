"""Supervised tuning: learn the answers of the examples. Its steps and evaluation are the packed documents' loss
(engine.run.step), the path every speed switch was built for; it refuses none."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.method_facts import FACTS
from engine.run.methods.base import HeldOut, StepTokens
from engine.run.methods.documents import DocumentMethod
from engine.run.step import accumulate_documents, evaluate_documents

if TYPE_CHECKING:
    import torch

    from engine.run.session import Session


class SftMethod(DocumentMethod):
    facts = FACTS["sft"]

    def accumulate(self, session: Session, rows: list[int]) -> tuple[torch.Tensor, StepTokens]:
        return accumulate_documents(session, rows)

    def evaluate(self, session: Session) -> HeldOut | None:
        result = evaluate_documents(session)
        return None if result is None else HeldOut(*result)
