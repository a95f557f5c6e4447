"""Direct preference optimization (DPO): each pair's chosen answer made likelier than its rejected one, relative to
a reference model.

Pairs pack like documents: a pair is one packed item, its chosen document (prompt + chosen answer) followed by its
rejected one, with positions restarting at each, so the packed attention path and its metadata cache keep them
apart and one forward over a row scores every answer in it. Logits are computed only at the answer tokens
(transformers' ``logits_to_keep``), never for the whole row. The reference is the same base model with the adapter
switched off (peft's ``disable_adapter``), run in eval mode under ``no_grad``: no second copy of the model, no
dropout, no recompute. Its log-probabilities never change, so each pair's are kept once computed (two floats a pair
on the device) and every pass after the first skips the reference forward.

The loss and the logged rewards follow TRL's DPOTrainer (``loss_type`` sigmoid, ipo, hinge; ``rewards/chosen``,
``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``), averaged over the pairs of an optimizer step.
Pairs are never split between micro-batches; the step's loss is the sum of its pairs' losses over their count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import functional as F

from engine.config import DpoConfig
from engine.data.packing import PackedBatch, TokenizedExample, TokenizedPair, collate
from engine.events import StepMetrics
from engine.run import guard

if TYPE_CHECKING:
    from engine.run.session import Session

REFERENCE_NOTE = (
    "the reference is the base model with the adapter switched off; its log-probabilities are kept for every pair "
    "after the first pass over the data"
)
STEP_GRAPHS_REFUSED = "DPO runs a reference pass with the adapter switched off beside each micro-batch"
FUSED_LOSS_REFUSED = "DPO scores answers by their log-probabilities: logits only at answer tokens instead"


def pair_losses(
    policy: torch.Tensor, reference: torch.Tensor, beta: float, loss: str, answer_tokens: torch.Tensor
) -> torch.Tensor:
    """Each pair's loss, TRL's formulas. ``policy``, ``reference``: (P, 2) summed log-probabilities of the chosen
    and rejected answers; ``answer_tokens``: (P, 2) their token counts (IPO compares per-token averages)."""
    ratios = policy - reference
    delta = ratios[:, 0] - ratios[:, 1]
    if loss == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss == "hinge":
        return torch.relu(1 - beta * delta)
    if loss == "ipo":
        averages = ratios / answer_tokens.clamp(min=1)
        return (averages[:, 0] - averages[:, 1] - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss {loss!r}")


def document_log_probs(model: Any, inputs: dict[str, Any], batch: PackedBatch) -> torch.Tensor:
    """(D,) each document's summed log-probability of its learned tokens; ``batch`` on the model's device, with
    ``loss_positions`` (the packer's host-side list, so nothing here asks the GPU which tokens count)."""
    positions = batch.loss_positions
    assert positions is not None, "collate lists the learned positions"
    logits = model(**inputs, logits_to_keep=positions).logits[0]
    targets = batch.labels[0, positions + 1]
    token_log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    documents = batch.document_ids[0, positions + 1].long()
    sums = torch.zeros(batch.num_documents, dtype=torch.float32, device=token_log_probs.device)
    return sums.index_add(0, documents, token_log_probs)


class ReferenceCache:
    """Reference log-probabilities (chosen, rejected) per pair, on the device, filled as pairs are first seen."""

    def __init__(self, pairs: int, device: torch.device) -> None:
        self.values = torch.zeros(pairs, 2, dtype=torch.float32, device=device)
        self.known = [False] * pairs

    def get(self, pairs: Sequence[int]) -> torch.Tensor | None:
        if not all(self.known[i] for i in pairs):
            return None
        return self.values[torch.tensor(list(pairs), device=self.values.device)]

    def put(self, pairs: Sequence[int], values: torch.Tensor) -> None:
        self.values[torch.tensor(list(pairs), device=self.values.device)] = values.detach().float()
        for i in pairs:
            self.known[i] = True


@dataclass
class RewardTotals:
    """Sums over a step's pairs of the chosen and rejected rewards and of the pairs ranked right (on the device)."""

    pairs: int = 0
    sums: torch.Tensor | None = None
    """(3,) chosen reward, rejected reward, correctly ranked."""

    def add(self, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        step = torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum()])
        self.sums = step if self.sums is None else self.sums + step
        self.pairs += int(chosen.numel())

    def means(self) -> tuple[float, float, float] | None:
        """Mean chosen reward, rejected reward and share ranked right (reads the device); None without pairs."""
        if self.sums is None or not self.pairs:
            return None
        chosen, rejected, correct = (value / self.pairs for value in self.sums.tolist())
        return chosen, rejected, correct

    def reported(self, metrics: StepMetrics) -> StepMetrics:
        """``metrics`` with the step's rewards."""
        means = self.means()
        if means is None:
            return metrics
        chosen, rejected, correct = means
        return dataclasses.replace(
            metrics,
            rewards_chosen=chosen,
            rewards_rejected=rejected,
            reward_margin=chosen - rejected,
            reward_accuracy=correct,
        )


@dataclass
class PreferenceTraining:
    """What a DPO run keeps between steps: its settings, the reference caches and the step's reward sums."""

    settings: DpoConfig
    train_reference: ReferenceCache
    eval_reference: ReferenceCache
    totals: RewardTotals = field(default_factory=RewardTotals)
    eval_accuracy: float | None = None

    @classmethod
    def for_run(
        cls, settings: DpoConfig, train_pairs: int, eval_pairs: int, device: torch.device
    ) -> PreferenceTraining:
        return cls(settings, ReferenceCache(train_pairs, device), ReferenceCache(eval_pairs, device))

    def describe(self) -> str:
        return f"DPO: beta {self.settings.beta:g}, {self.settings.loss} loss; {REFERENCE_NOTE}"


@dataclass(frozen=True)
class PairScores:
    """One micro-batch of pairs: their losses and rewards (P,)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def _reference(session: Session, batch: PackedBatch, pairs: Sequence[int], cache: ReferenceCache) -> torch.Tensor:
    """(P, 2) reference log-probabilities: kept ones, or one pass with the adapter off."""
    kept = cache.get(pairs)
    if kept is not None:
        return kept
    model = session.model
    training = model.training
    model.eval()  # no dropout; transformers' checkpointing runs only in training mode
    try:
        with torch.no_grad(), model.disable_adapter():
            inputs = session.speed.model_inputs(batch, timed=False)
            values = document_log_probs(model, inputs, batch).view(-1, 2)
    finally:
        model.train(training)
    cache.put(pairs, values)
    return values


def score_pairs(
    session: Session, pairs: Sequence[int], examples: Sequence[TokenizedExample], cache: ReferenceCache
) -> PairScores:
    """Forward one micro-batch of pairs (indices into ``examples``) through the reference and the policy."""
    items = [examples[i] for i in pairs]
    batch = collate(items).to(session.device)
    reference = _reference(session, batch, pairs, cache)
    policy = document_log_probs(session.model, session.speed.model_inputs(batch), batch).view(-1, 2)
    counts = [item.answer_tokens if isinstance(item, TokenizedPair) else (1, 1) for item in items]
    answer_tokens = torch.tensor(counts, dtype=torch.float32, device=policy.device)
    assert session.preference is not None
    settings = session.preference.settings
    losses = pair_losses(policy, reference, settings.beta, settings.loss, answer_tokens)
    rewards = settings.beta * (policy - reference).detach()
    return PairScores(losses, rewards[:, 0], rewards[:, 1])


def _micro_batches(session: Session, examples: Sequence[TokenizedExample], row: Sequence[int]) -> list[list[int]]:
    """A packed row's pairs in micro-batches of whole pairs (one unless memory ran short)."""
    groups = guard.split_row([len(examples[i]) for i in row], session.tokens_per_batch)
    return [[row[position] for position in group] for group in groups]


def accumulate_pairs(session: Session, rows: Sequence[int]) -> tuple[torch.Tensor, int, int]:
    """Forward and backward over the step's packed rows of pairs: (the step's loss on the device, tokens in its
    rows, learned answer tokens). The step's reward sums go to ``session.preference.totals``."""
    state = session.preference
    assert state is not None
    data = session.data
    items = [i for r in rows for i in data.train_rows[r]]
    state.totals = RewardTotals()
    total = torch.zeros((), device=session.device)
    for r in rows:
        for pairs in _micro_batches(session, data.train, data.train_rows[r]):
            scores = score_pairs(session, pairs, data.train, state.train_reference)
            loss = scores.losses.sum() / len(items)
            (session.scaler.scale(loss) if session.scaler is not None else loss).backward()
            total += loss.detach().float()
            state.totals.add(scores.chosen_rewards, scores.rejected_rewards)
    tokens = sum(len(data.train[i]) for i in items)
    return total, tokens, sum(data.train[i].trained_tokens for i in items)


@torch.no_grad()
def evaluate_pairs(session: Session) -> tuple[float, int] | None:
    """Mean DPO loss over the held-out pairs and their learned tokens, or None without an eval split; the share of
    pairs ranked right goes to ``session.preference.eval_accuracy``."""
    state = session.preference
    assert state is not None
    data = session.data
    if not data.eval_rows:
        return None
    totals, loss = RewardTotals(), torch.zeros((), device=session.device)
    session.model.eval()
    try:
        for row in data.eval_rows:
            for pairs in _micro_batches(session, data.eval, row):
                scores = score_pairs(session, pairs, data.eval, state.eval_reference)
                loss += scores.losses.sum()
                totals.add(scores.chosen_rewards, scores.rejected_rewards)
    finally:
        session.model.train()
    means = totals.means()
    state.eval_accuracy = None if means is None else means[2]
    tokens = sum(data.eval[i].trained_tokens for row in data.eval_rows for i in row)
    return float(loss) / max(totals.pairs, 1), tokens
