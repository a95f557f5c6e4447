"""Preference tuning (DPO): each pair's chosen answer made likelier than its rejected one, against a reference
(engine.run.preference holds the losses and the kept reference, engine.run.preference_step the passes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from engine.events import Event, Notice, StepMetrics
from engine.method_facts import FACTS
from engine.run import preference_step
from engine.run.methods.base import HeldOut, StepTokens
from engine.run.methods.documents import DocumentMethod
from engine.run.preference import PreferenceTraining

if TYPE_CHECKING:
    import torch

    from engine.run.session import Session


class DpoMethod(DocumentMethod):
    facts = FACTS["dpo"]

    def __init__(self) -> None:
        self._state: PreferenceTraining | None = None

    @property
    def state(self) -> PreferenceTraining:
        """The run's settings, reference caches and the step's reward sums (set up by :meth:`begin`)."""
        assert self._state is not None, "begin() sets the DPO state up"
        return self._state

    def begin(self, session: Session) -> Iterator[Event]:
        config, data = session.config, session.data
        self._state = PreferenceTraining.for_run(
            config.dpo, len(data.train), len(data.eval), session.device, config.model.adapter is not None
        )
        yield Notice(self._state.describe())

    def before_first_step(self, session: Session) -> Iterator[Event]:
        yield from preference_step.score_start(session, self.state)

    def after_restore(self, session: Session) -> Iterator[Event]:
        if session.step > 0 and self.state.missing_start():
            self.state.fall_back_to_base()  # the model has moved: its start cannot be scored again
            yield Notice(
                "this run's checkpoint keeps no reference log-probabilities (it was made before checkpoints kept "
                "them, when DPO measured against the base model): the reference stays the base model with the "
                "adapter switched off"
            )

    def accumulate(self, session: Session, rows: list[int]) -> tuple[torch.Tensor, StepTokens]:
        total, tokens, trained = preference_step.accumulate_pairs(session, self.state, rows)
        return total, StepTokens(tokens, trained)

    def reported(self, metrics: StepMetrics) -> StepMetrics:
        return self.state.totals.reported(metrics)

    def evaluate(self, session: Session) -> HeldOut | None:
        result = preference_step.evaluate_pairs(session, self.state)
        return None if result is None else HeldOut(*result, reward_accuracy=self.state.eval_accuracy)

    def kept_state(self) -> dict[str, torch.Tensor] | None:
        return self.state.saved()

    def restore_state(self, saved: dict[str, torch.Tensor] | None) -> None:
        self.state.restore(saved)
