"""One training method behind one small interface: what its data rows are, how a step's rows become a loss and its
logged figures, what it evaluates, what it keeps in checkpoints and which speed switches it refuses.

The session, the step and the loop call a :class:`TrainingMethod` and never ask for its name, so a new method is
one new module here (TRL keeps one trainer per method over shared collators; torchtune one recipe per method over
shared components). A method object lives as long as its run: state it keeps between steps (DPO's reference
log-probabilities, GRPO's sampled groups) is its own. The ``session`` each hook takes is the run's
:class:`engine.run.session.Session` (typed ``Any`` here: the session holds its method, so this module cannot
import it back).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import DataConfig, RunConfig
from engine.data.prepare import PreparedData
from engine.events import Event, StepMetrics
from engine.method_facts import MethodFacts

if TYPE_CHECKING:
    import torch

    from engine.data.files import Example


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
    reward_mean: float | None = None


class TrainingMethod(ABC):
    """What one training method does inside the shared loop (see the module docstring)."""

    facts: MethodFacts
    """The method's fixed facts (engine.method_facts): its name, how it packs, what it refuses."""

    @property
    def name(self) -> str:
        return self.facts.name

    @abstractmethod
    def prepare(
        self, config: DataConfig, tokenizer: Any, seed: int, extra_train: Sequence[Example] = ()
    ) -> PreparedData:
        """The run's training and held-out rows (``extra_train``: the base model's own answers to mix in)."""

    @abstractmethod
    def dataset_size(self, config: RunConfig, tokenizer: Any) -> tuple[int, int]:
        """(examples, tokens) of the training file, for the automatic settings."""

    @abstractmethod
    def longest_document(self, config: RunConfig, tokenizer: Any) -> int:
        """The most tokens one document must hold, uncut: what the row length must hold on a CPU."""

    def total_steps(self, config: RunConfig, rows: int) -> int:
        """Optimizer steps of the run over ``rows`` training rows (``max_steps``, else ``epochs`` passes)."""
        training = config.training
        if training.max_steps:
            return training.max_steps
        return max(1, math.ceil(training.epochs * rows / training.grad_accum))

    def begin(self, session: Any) -> Iterator[Event]:
        """Set up what the run keeps between steps, once the session is built; say what matters about it."""
        yield from ()

    def before_first_step(self, session: Any) -> Iterator[Event]:
        """Work due before the first update (and after a resume's restore)."""
        yield from ()

    def after_restore(self, session: Any) -> Iterator[Event]:
        """Adjust after a checkpoint was restored at ``session.step``."""
        yield from ()

    @abstractmethod
    def accumulate(self, session: Any, rows: list[int]) -> tuple[torch.Tensor, StepTokens]:
        """Forward and backward over a step's rows; the step's loss (on the device) and what it trained on."""

    def reported(self, metrics: StepMetrics) -> StepMetrics:
        """``metrics`` with the method's own figures of the step just taken."""
        return metrics

    def after_step(self, step: int) -> Iterator[Event]:
        """Events beside a step's metrics (GRPO: a few of its sampled answers)."""
        yield from ()

    @abstractmethod
    def evaluate(self, session: Any) -> HeldOut | None:
        """The held-out figure the best adapter is chosen by, or None without held-out data."""

    def kept_state(self) -> dict[str, torch.Tensor] | None:
        """What a checkpoint keeps for this method beside the adapter and optimizer (None: nothing)."""
        return None

    def restore_state(self, saved: dict[str, torch.Tensor] | None) -> None:
        """Take back what :meth:`kept_state` gave, from a checkpoint (None: it kept nothing)."""
        return None
