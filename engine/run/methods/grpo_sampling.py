"""Sampling GRPO's groups from the live model: the adapter being trained, in this process, with no copy and no
reload. ``model.generate`` on the peft model in eval mode under ``no_grad`` (no dropout, no recompute), with the KV
cache, the group and the prompts in one left-padded batch (split where it would exceed ``GENERATION_BATCH``
answers); the model goes back to training mode after.

The same padded layout serves the update pass: each prompt left-padded, each answer right-padded, position ids
counted from the first real token, and logits kept only at answer tokens (transformers' ``logits_to_keep``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

GENERATION_BATCH = 64
"""Most answers one ``generate`` call samples at once."""


@dataclass(frozen=True)
class SampleSettings:
    """How a group is sampled (TRL's names in brackets): answers per prompt (num_generations), temperature, top-p,
    and new tokens at most (max_completion_length)."""

    group: int
    temperature: float
    top_p: float
    max_new_tokens: int


def _left_padded(prompts: Sequence[Sequence[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def cut_at_stop(ids: Sequence[int], stops: Sequence[int]) -> list[int]:
    """``ids`` up to and including the first stop token (what an answer is: its end token is learned too)."""
    stop_set = set(stops)
    for place, token in enumerate(ids):
        if token in stop_set:
            return list(ids[: place + 1])
    return list(ids)


@torch.no_grad()
def sample_answers(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    settings: SampleSettings,
    pad: int,
    stops: Sequence[int],
    greedy: bool = False,
) -> list[list[int]]:
    """``settings.group`` sampled answers to each prompt (prompt-major: a prompt's group is consecutive), each up to
    and including its first stop token; ``greedy``: one greedy answer per prompt."""
    device = next(model.parameters()).device
    repeated = [list(p) for p in prompts for _ in range(1 if greedy else settings.group)]
    answers: list[list[int]] = []
    training = model.training
    model.eval()
    try:
        for start in range(0, len(repeated), GENERATION_BATCH):
            chunk = repeated[start : start + GENERATION_BATCH]
            ids, mask = _left_padded(chunk, pad, device)
            sampling: dict[str, Any] = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
            if not greedy:
                sampling = {"do_sample": True, "temperature": settings.temperature, "top_p": settings.top_p, "top_k": 0}
            output = model.generate(  # type: ignore[operator]
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=settings.max_new_tokens,
                use_cache=True,
                eos_token_id=list(stops) or None,
                pad_token_id=pad,
                **sampling,
            )
            answers += [cut_at_stop(row[ids.shape[1] :].tolist(), stops) for row in output]
    finally:
        model.train(training)
    return answers


@dataclass(frozen=True)
class AnswerBatch:
    """Prompts and answers as one padded batch: ``input_ids``/``attention_mask`` (N, P + C), ``answer_ids`` and
    ``answer_mask`` (N, C); position ids count real tokens only, so padding moves nothing."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    answer_ids: torch.Tensor
    answer_mask: torch.Tensor


def answer_batch(
    prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], pad: int, device: torch.device
) -> AnswerBatch:
    prompt_ids, prompt_mask = _left_padded(prompts, pad, device)
    width = max(max((len(a) for a in answers), default=0), 1)
    answer_ids = torch.tensor([list(a) + [pad] * (width - len(a)) for a in answers], device=device)
    answer_mask = torch.tensor([[1] * len(a) + [0] * (width - len(a)) for a in answers], device=device)
    mask = torch.cat([prompt_mask, answer_mask], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return AnswerBatch(torch.cat([prompt_ids, answer_ids], dim=1), mask, positions, answer_ids, answer_mask)


def answer_log_probs(model: torch.nn.Module, batch: AnswerBatch, temperature: float) -> torch.Tensor:
    """(N, C) each answer token's log-probability under ``model`` (with the gradient where it is on), from logits
    divided by the sampling temperature, as TRL scores them."""
    width = batch.answer_ids.shape[1]
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=width + 1,
        use_cache=False,
    ).logits[:, :-1]
    log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return log_probs.gather(-1, batch.answer_ids.unsqueeze(-1)).squeeze(-1)
