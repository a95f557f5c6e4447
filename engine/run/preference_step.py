"""A DPO run's steps: the reference pass (before the first step for a run measured against its starting adapter,
else kept per pair after the first), the pairs of an optimizer step scored and backpropagated micro-batch by
micro-batch, and the held-out pairs' loss and reward accuracy (:mod:`engine.run.preference` holds the losses, the
kept reference and the run's settings)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from engine.data.packing import PackedBatch, TokenizedExample, TokenizedPair, collate
from engine.events import Event, Notice
from engine.run import guard
from engine.run.preference import (
    PairScores,
    PreferenceTraining,
    ReferenceCache,
    RewardTotals,
    document_log_probs,
    pair_losses,
)
from engine.run.session import Session
from engine.speed.stand_in import adapters_off


def _reference(
    session: Session, state: PreferenceTraining, batch: PackedBatch, pairs: Sequence[int], cache: ReferenceCache
) -> torch.Tensor:
    """(P, 2) reference log-probabilities: kept ones, or one pass with the adapter off (the base model)."""
    kept = cache.get(pairs)
    if kept is not None:
        return kept
    if state.from_start:  # the start was scored before the first step; the model has moved since
        raise RuntimeError("the starting model's reference log-probabilities were not computed before training")
    values = _reference_pass(session, batch, adapter_on=False)
    cache.put(pairs, values)
    return values


def _reference_pass(session: Session, batch: PackedBatch, adapter_on: bool) -> torch.Tensor:
    """(P, 2) log-probabilities of ``batch``'s pairs in eval mode, without gradients, the adapter on or off."""
    model = session.model
    training = model.training
    model.eval()  # no dropout; transformers' checkpointing runs only in training mode
    try:
        with torch.no_grad(), contextlib.nullcontext() if adapter_on else adapters_off(model):
            inputs = session.speed.model_inputs(batch, timed=False)
            return document_log_probs(model, inputs, batch).view(-1, 2)
    finally:
        model.train(training)


def score_start(session: Session, state: PreferenceTraining) -> Iterator[Event]:
    """Score every training and held-out pair with the model as it starts (its starting adapter on), before the
    first step, where the run's reference is its start; nothing to do otherwise or once they are known (a run
    resumed from a checkpoint that kept them)."""
    if not state.missing_start():
        return
    data = session.data
    yield Notice(f"scoring the {len(data.train) + len(data.eval)} pairs with the starting adapter: DPO's reference")
    for examples, rows, cache in (
        (data.train, data.train_rows, state.train_reference),
        (data.eval, data.eval_rows, state.eval_reference),
    ):
        for row in rows:
            for pairs in _micro_batches(session, examples, row):
                batch = collate([examples[i] for i in pairs]).to(session.device)
                cache.put(pairs, _reference_pass(session, batch, adapter_on=True))


def score_pairs(
    session: Session,
    state: PreferenceTraining,
    pairs: Sequence[int],
    examples: Sequence[TokenizedExample],
    cache: ReferenceCache,
) -> PairScores:
    """Forward one micro-batch of pairs (indices into ``examples``) through the reference and the policy."""
    items = [examples[i] for i in pairs]
    batch = collate(items).to(session.device)
    reference = _reference(session, state, batch, pairs, cache)
    policy = document_log_probs(session.model, session.speed.model_inputs(batch), batch).view(-1, 2)
    counts = [item.answer_tokens if isinstance(item, TokenizedPair) else (1, 1) for item in items]
    answer_tokens = torch.tensor(counts, dtype=torch.float32, device=policy.device)
    settings = state.settings
    losses = pair_losses(policy, reference, settings.beta, settings.loss, answer_tokens)
    rewards = settings.beta * (policy - reference).detach()
    return PairScores(losses, rewards[:, 0], rewards[:, 1])


def _micro_batches(session: Session, examples: Sequence[TokenizedExample], row: Sequence[int]) -> list[list[int]]:
    """A packed row's pairs in micro-batches of whole pairs (one unless memory ran short)."""
    groups = guard.split_row([len(examples[i]) for i in row], session.tokens_per_batch)
    return [[row[position] for position in group] for group in groups]


def accumulate_pairs(session: Session, state: PreferenceTraining, rows: Sequence[int]) -> tuple[torch.Tensor, int, int]:
    """Forward and backward over the step's packed rows of pairs: (the step's loss on the device, tokens in its
    rows, learned answer tokens). The step's reward sums go to ``state.totals``."""
    data = session.data
    items = [i for r in rows for i in data.train_rows[r]]
    state.totals = RewardTotals()
    total = torch.zeros((), device=session.device)
    for r in rows:
        for pairs in _micro_batches(session, data.train, data.train_rows[r]):
            scores = score_pairs(session, state, pairs, data.train, state.train_reference)
            loss = scores.losses.sum() / len(items)
            (session.scaler.scale(loss) if session.scaler is not None else loss).backward()
            total += loss.detach().float()
            state.totals.add(scores.chosen_rewards, scores.rejected_rewards)
    tokens = sum(len(data.train[i]) for i in items)
    return total, tokens, sum(data.train[i].trained_tokens for i in items)


@torch.no_grad()
def evaluate_pairs(session: Session, state: PreferenceTraining) -> tuple[float, int] | None:
    """Mean DPO loss over the held-out pairs and their learned tokens, or None without an eval split; the share of
    pairs ranked right goes to ``state.eval_accuracy``."""
    data = session.data
    if not data.eval_rows:
        return None
    totals, loss = RewardTotals(), torch.zeros((), device=session.device)
    session.model.eval()
    try:
        for row in data.eval_rows:
            for pairs in _micro_batches(session, data.eval, row):
                scores = score_pairs(session, state, pairs, data.eval, state.eval_reference)
                loss += scores.losses.sum()
                totals.add(scores.chosen_rewards, scores.rejected_rewards)
    finally:
        session.model.train()
    means = totals.means()
    state.eval_accuracy = None if means is None else means[2]
    tokens = sum(data.eval[i].trained_tokens for row in data.eval_rows for i in row)
    return float(loss) / max(totals.pairs, 1), tokens
