"""Direct preference optimization (DPO): each pair's chosen answer made likelier than its rejected one, relative to
a reference model.

Pairs pack like documents: a pair is one packed item, its chosen document (prompt + chosen answer) followed by its
rejected one, with positions restarting at each, so the packed attention path and its metadata cache keep them
apart and one forward over a row scores every answer in it. Logits are computed only at the answer tokens
(transformers' ``logits_to_keep``), never for the whole row.

The reference is the model the run starts from, as the DPO paper and TRL define it (``dpo.reference`` "start"), or
the base model with the adapter off (``dpo.reference`` "base"). It is never a second copy of the model:

* a run from an earlier adapter (``model.adapter``) with the "start" reference scores every pair, training and
  held-out, once before its first step with the model exactly as it starts (TRL's ``precompute_ref_log_probs``),
  and checkpoints keep those log-probabilities, so a resumed run measures against the same start. A frozen copy of
  the starting adapter beside the trained one (TRL's "ref" adapter) would cost no more memory, but every speed
  switch that wraps or re-routes the LoRA layers (the 16-bit LoRA path, its grouped A products, the stand-ins of
  engine.speed.stand_in) would then have to keep two adapters apart and switch between them inside a step; a pass
  before the first step runs the model as it trains, with nothing to switch;
* otherwise the reference is the base model: a fresh adapter's B matrices are zero, so the model as it starts *is*
  the base, and the reference pass runs with peft's adapters switched off (``adapters_off``, which sees through the
  speed stand-ins) the first time a pair is met; its two floats are kept and every later pass skips it.

Either way the reference pass runs in eval mode under ``no_grad``: no dropout, no recompute.

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
    "the reference is the model as the run starts, its starting adapter on; every pair's log-probabilities are "
    "computed once before the first step and kept in checkpoints"
)
BASE_REFERENCE_NOTE = (
    "the reference is the base model with the adapter switched off; its log-probabilities are kept for every pair "
    "after the first pass over the data"
)
FRESH_START_NOTE = (
    "the reference is the model as the run starts, which with a fresh adapter is the base model: the adapter is "
    "switched off for it, and its log-probabilities are kept for every pair after the first pass over the data"
)


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

    def complete(self) -> bool:
        return all(self.known)

    def saved(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, known) on the host, for a checkpoint."""
        return self.values.detach().cpu(), torch.tensor(self.known, dtype=torch.bool)

    def restore(self, values: torch.Tensor, known: torch.Tensor) -> bool:
        """Take kept values back from a checkpoint; False (nothing taken) when they are for another number of
        pairs."""
        if tuple(values.shape) != tuple(self.values.shape) or known.numel() != len(self.known):
            return False
        self.values.copy_(values.to(self.values.device, torch.float32))
        self.known = [bool(k) for k in known.tolist()]
        return True


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
    from_start: bool = False
    """The reference is the starting adapter's model, scored for every pair before the first step (a run from an
    earlier adapter, ``dpo.reference`` start); False: the base model, scored with the adapter off as pairs come."""
    starts_from_adapter: bool = False
    totals: RewardTotals = field(default_factory=RewardTotals)
    eval_accuracy: float | None = None

    @classmethod
    def for_run(
        cls, settings: DpoConfig, train_pairs: int, eval_pairs: int, device: torch.device, starts_from_adapter: bool
    ) -> PreferenceTraining:
        from_start = starts_from_adapter and settings.reference == "start"
        caches = ReferenceCache(train_pairs, device), ReferenceCache(eval_pairs, device)
        return cls(settings, *caches, from_start=from_start, starts_from_adapter=starts_from_adapter)

    def describe(self) -> str:
        if self.from_start:
            note = REFERENCE_NOTE
        else:
            note = BASE_REFERENCE_NOTE if self.starts_from_adapter else FRESH_START_NOTE
        return f"DPO: beta {self.settings.beta:g}, {self.settings.loss} loss; {note}"

    def saved(self) -> dict[str, torch.Tensor]:
        """The reference log-probabilities kept so far, as a checkpoint holds them."""
        train, train_known = self.train_reference.saved()
        held_out, held_out_known = self.eval_reference.saved()
        return {"train": train, "train_known": train_known, "eval": held_out, "eval_known": held_out_known}

    def restore(self, saved: dict[str, torch.Tensor] | None) -> bool:
        """Take the reference log-probabilities back from a checkpoint; False when it held none for these pairs."""
        if saved is None or not {"train", "train_known", "eval", "eval_known"} <= set(saved):
            return False
        train = self.train_reference.restore(saved["train"], saved["train_known"])
        return train and self.eval_reference.restore(saved["eval"], saved["eval_known"])

    def missing_start(self) -> bool:
        """The start's reference is not (all) known: it must be scored before the first step."""
        return self.from_start and not (self.train_reference.complete() and self.eval_reference.complete())

    def fall_back_to_base(self) -> None:
        """Measure against the base model from now on (a checkpoint made before the start's log-probabilities were
        kept in checkpoints was trained against the base)."""
        self.from_start = False
        self.train_reference = ReferenceCache(len(self.train_reference.known), self.train_reference.values.device)
        self.eval_reference = ReferenceCache(len(self.eval_reference.known), self.eval_reference.values.device)


@dataclass(frozen=True)
class PairScores:
    """One micro-batch of pairs: their losses and rewards (P,)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
