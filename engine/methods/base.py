"""One training method behind one small interface: what its data rows are, how a step's rows become a loss and its
logged figures, what it evaluates, what it keeps in checkpoints and which speed switches it refuses.

The session, the step and the loop call a :class:`TrainingMethod` and never ask for its name, so a new method is
one new module here (TRL keeps one trainer per method over shared collators; torchtune one recipe per method over
shared components). A method object lives as long as its run: state it keeps between steps (DPO's reference
log-probabilities, GRPO's sampled groups) is its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import DataConfig, RunConfig
from engine.events import Event, StepMetrics
from engine.methods.facts import MethodFacts

if TYPE_CHECKING:
    import torch

    from engine.data.files import Example
    from engine.data.prepare import PreparedData
    from engine.run.report import ReportSection
    from engine.run.session import Session


@dataclass(frozen=True)
class StepTokens:
    """What a step trained on, over all ranks: tokens in its rows and tokens that count in the loss."""

    tokens: int
    trained: int


@dataclass(frozen=True)
class HeldOut:
    """One evaluation: the held-out loss (what the best adapter is chosen by: lower is better), the tokens it was
    measured on, and the method's own figure beside it (DPO's reward accuracy; GRPO's mean reward)."""

    loss: float
    tokens: int
    reward_accuracy: float | None = None


class TrainingMethod(ABC):
    """What one training method does inside the shared loop (see the module docstring)."""

    facts: MethodFacts
    """The method's fixed facts (engine.methods.facts): its name, how it packs, what it refuses."""

    @property
    def name(self) -> str:
        return self.facts.name

    def prepare(
        self, config: DataConfig, tokenizer: Any, seed: int, extra_train: Sequence[Example] = ()
    ) -> PreparedData:
        """The run's training and held-out rows."""
        from engine.data.prepare import prepare_data

        return prepare_data(config, tokenizer, seed, self.name, extra_train=extra_train)

    def dataset_size(self, config: RunConfig, tokenizer: Any) -> tuple[int, int]:
        """(examples, tokens) of the training file, for the automatic settings."""
        from engine.run.fit import dataset_size

        return dataset_size(config, tokenizer)

    def longest_document(self, data: DataConfig, tokenizer: Any) -> int:
        """The most tokens one document of the data has, uncut: what the row length must hold on a CPU."""
        from engine.run.rows import longest_example

        return longest_example(data, tokenizer)

    def begin(self, session: Session) -> Iterator[Event]:
        """Set up what the run keeps between steps, once the session is built; say what matters about it."""
        yield from ()

    def before_first_step(self, session: Session) -> Iterator[Event]:
        """Work due before the first update (and after a resume's restore)."""
        yield from ()

    def after_restore(self, session: Session) -> Iterator[Event]:
        """Adjust after a checkpoint was restored at ``session.step``."""
        yield from ()

    @abstractmethod
    def accumulate(self, session: Session, rows: list[int]) -> tuple[torch.Tensor, StepTokens]:
        """Forward and backward over a step's rows; the step's loss (on the device) and what it trained on."""

    def reported(self, metrics: StepMetrics) -> StepMetrics:
        """``metrics`` with the method's own figures of the step just taken."""
        return metrics

    @abstractmethod
    def evaluate(self, session: Session) -> HeldOut | None:
        """The held-out figure the best adapter is chosen by, or None without held-out data."""

    def kept_state(self) -> dict[str, torch.Tensor] | None:
        """What a checkpoint keeps for this method beside the adapter and optimizer (None: nothing)."""
        return None

    def restore_state(self, saved: dict[str, torch.Tensor] | None) -> None:
        """Take back what :meth:`kept_state` gave, from a checkpoint (None: it kept nothing)."""
        return None

    def report_section(self) -> ReportSection:
        """What the before/after report measures for this method's runs (engine.run.report)."""
        from engine.run.report import DOCUMENTS_SECTION

        return DOCUMENTS_SECTION
