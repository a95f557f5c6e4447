"""GRPO's arithmetic, TRL's formulas (GRPOTrainer, TRL 1.16): advantages normalised within each prompt's group,
the clipped objective per completion token, the KL penalty to the base model, and the loss variants TRL names
(``loss_type``): grpo, bnpo, dr_grpo, dapo.

A step's completions may be split into several micro-batches; every normaliser is the whole step's (its
completions, their tokens), so the loss and its gradient do not depend on the split. TRL's numbers are those of a
step that is one micro-batch (bnpo averages each micro-batch's tokens in TRL; here the step's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_FLOOR = 1e-4
"""Added to the standard deviation before dividing by it (TRL's), so a group of equal rewards gives zero advantage."""
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def group_advantages(rewards: torch.Tensor, group: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, the standard deviation used) for ``rewards`` (N,) in groups of ``group`` consecutive
    completions: the reward minus its group's mean, over the group's standard deviation (``scale`` group), the whole
    batch's (batch) or not scaled (none). Standard deviations are unbiased, as TRL's."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(dim=1).repeat_interleave(group)
    if scale in ("group", "none"):
        std = grouped.std(dim=1).repeat_interleave(group) if group > 1 else torch.zeros_like(rewards)
    elif scale == "batch":
        std = rewards.std().expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        raise ValueError(f"unknown scale_rewards {scale!r}: group, batch or none")
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + STD_FLOOR)
    return advantages, std


@dataclass(frozen=True)
class ClipSettings:
    """The clipped objective's settings (TRL's names)."""

    epsilon_low: float
    epsilon_high: float
    beta: float
    sampling_level: str = "token"
    """Importance ratio per token, or one per completion (its tokens' mean log-ratio): TRL's
    ``importance_sampling_level``."""


@dataclass(frozen=True)
class TokenTerms:
    """Per completion token (N, T) or per completion (N, 1) at the sequence level: the loss, the KL penalty (None
    with beta 0) and where the ratio was clipped."""

    loss: torch.Tensor
    kl: torch.Tensor | None
    clipped: torch.Tensor


def token_terms(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    base_log_probs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: ClipSettings,
) -> TokenTerms:
    """The clipped surrogate with TRL's two-sided clip and its KL estimator (k3, times the importance ratio: TRL's
    ``use_bias_correction_kl``, on by default). ``log_probs`` (N, T) carry the gradient; ``old_log_probs`` are the
    sampling policy's (the same values, detached, on the first pass over a generation)."""
    log_ratio = log_probs - old_log_probs
    if settings.sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
    advantage = advantages.unsqueeze(1)
    loss = -torch.min(ratio * advantage, clipped_ratio * advantage)
    kl = None
    if settings.beta != 0.0:
        assert base_log_probs is not None, "a KL penalty needs the base model's log-probabilities"
        delta = base_log_probs - log_probs
        kl = (torch.exp(delta) - delta - 1) * ratio
        loss = loss + settings.beta * kl
    low = (ratio < 1 - settings.epsilon_low) & (advantage < 0)
    high = (ratio > 1 + settings.epsilon_high) & (advantage > 0)
    return TokenTerms(loss, kl, low | high)


@dataclass(frozen=True)
class StepShape:
    """What every loss normaliser of a step counts: its completions, their learned tokens, the longest allowed."""

    completions: int
    tokens: int
    max_new_tokens: int


def step_loss(loss: torch.Tensor, mask: torch.Tensor, loss_type: str, shape: StepShape) -> torch.Tensor:
    """This micro-batch's share of the step's loss (the shares add up to TRL's loss of the whole step):
    grpo averages each completion's tokens, then the completions; bnpo and dapo average all tokens of the step;
    dr_grpo divides the token sum by completions × max new tokens (no length bias)."""
    mask = mask.to(loss.dtype)
    if loss.shape[1] == 1:  # one term per completion (sequence level), counted once per learned token
        loss = loss.expand_as(mask)
    if loss_type == "grpo":
        per_completion = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_completion.sum() / shape.completions
    if loss_type in ("bnpo", "dapo"):
        return (loss * mask).sum() / max(shape.tokens, 1)
    if loss_type == "dr_grpo":
        return (loss * mask).sum() / (shape.completions * shape.max_new_tokens)
    raise ValueError(f"unknown loss_type {loss_type!r}: {', '.join(LOSS_TYPES)}")


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of ``values`` over learned tokens; per-completion values (N, 1) count once per completion."""
    if values.shape[1] == 1:
        return values.sum(), torch.tensor(float(values.shape[0]), device=values.device)
    mask = mask.to(values.dtype)
    return (values * mask).sum(), mask.sum()
