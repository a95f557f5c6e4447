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
from typing import Any

import torch
from torch.nn import functional as F

from engine.config import DpoConfig
from engine.data.packing import PackedBatch
from engine.events import StepMetrics

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
