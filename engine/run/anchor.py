"""The knowledge anchor: a penalty on drifting from the base model on general prompts, added to every step.

Mixing the base model's greedy answers into the training rows (engine.run.replay) keeps the tuned model's answers to
those prompts, but only their single most likely wording; what the base model would have said elsewhere still
drifts. The anchor asks more: on a few of those prompts each step, the tuned model's whole next-token distribution
over the answer is pulled toward the base model's (the KL divergence from the base to the tuned model, as in
learning without forgetting, LwF 2016, and the KL-to-reference term of RLHF). The base model is the same model with
its adapter switched off (no second copy); its distribution is computed under ``no_grad`` each time, so the anchor
costs two small forward passes and one backward a step, over :data:`BATCH_SIZE` short rows.

One process only: the penalty's gradients join the step's before the optimizer reads them, which several processes
would have to all-reduce in step with the rows (a run over several GPUs goes on without it and says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.speed.stand_in import adapters_off

BATCH_SIZE = 4
"""Replay rows the penalty reads each step (cycled through in a fixed order)."""


@dataclass(frozen=True)
class AnchorRow:
    """One general prompt with the base model's answer, as token ids; ``answer_from`` is where the answer starts."""

    ids: tuple[int, ...]
    answer_from: int


@dataclass
class KnowledgeAnchor:
    """The penalty: ``weight`` times the mean KL divergence from the base model over the answer tokens."""

    rows: Sequence[AnchorRow]
    weight: float
    pad_id: int
    device: torch.device
    position: int = 0
    last_value: float | None = field(default=None)

    def next_rows(self) -> list[AnchorRow]:
        count = min(BATCH_SIZE, len(self.rows))
        chosen = [self.rows[(self.position + i) % len(self.rows)] for i in range(count)]
        self.position = (self.position + count) % len(self.rows)
        return chosen

    def tokens_per_step(self) -> float:
        """The padded tokens a step reads on average (each batch as wide as its longest row), for the time a run
        expects."""
        widths = []
        for start in range(0, len(self.rows), BATCH_SIZE):
            batch = [self.rows[(start + i) % len(self.rows)] for i in range(min(BATCH_SIZE, len(self.rows)))]
            widths.append(len(batch) * max(len(row.ids) for row in batch))
        return sum(widths) / len(widths) if widths else 0.0

    def backward(self, model: Any) -> torch.Tensor:
        """Add the penalty's gradients for the next rows to the model's; the penalty, detached (on the device)."""
        rows = self.next_rows()
        ids, attention, answer = padded(rows, self.pad_id, self.device)
        start = min(row.answer_from for row in rows) - 1  # the first position that predicts an answer token
        keep = {"logits_to_keep": ids.shape[1] - start}  # the prompts' logits are never read: not computed
        was_training = model.training
        model.eval()  # no dropout: the base and the tuned model see the rows the same way
        try:
            with torch.no_grad(), adapters_off(model):
                base = model(input_ids=ids, attention_mask=attention, **keep).logits[:, :-1].float()
            tuned = model(input_ids=ids, attention_mask=attention, **keep).logits[:, :-1].float()
            penalty = self.weight * kl_from_base(base, tuned, answer[:, start + 1 :])
            penalty.backward()
        finally:
            model.train(was_training)
        return penalty.detach()


def kl_from_base(base_logits: torch.Tensor, tuned_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the masked positions of KL(base || tuned) between the next-token distributions."""
    base = torch.log_softmax(base_logits, dim=-1)
    tuned = torch.log_softmax(tuned_logits, dim=-1)
    per_position = (base.exp() * (base - tuned)).sum(-1)
    counted = mask.to(per_position.dtype)
    return (per_position * counted).sum() / counted.sum().clamp(min=1)


def padded(
    rows: Sequence[AnchorRow], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, the attention mask, and the mask of the tokens each answer is made of."""
    width = max(len(row.ids) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    answer = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row.ids)] = torch.tensor(row.ids)
        attention[i, : len(row.ids)] = 1
        answer[i, row.answer_from : len(row.ids)] = True
    return ids.to(device), attention.to(device), answer.to(device)


def anchor_rows(tokenizer: Any, replay: Sequence[dict[str, str]]) -> list[AnchorRow]:
    """The replay rows (prompt and the base model's answer) as token ids in the model's chat template."""
    rows = []
    for row in replay:
        prompt = _ids(tokenizer, [{"role": "user", "content": row["prompt"]}], generation=True)
        whole = _ids(
            tokenizer,
            [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["answer"]}],
            generation=False,
        )
        if len(whole) > len(prompt) and whole[: len(prompt)] == prompt:
            rows.append(AnchorRow(tuple(whole), len(prompt)))
    return rows


def _ids(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
