"""Learning from rewards (GRPO): for each prompt the live model samples a group of answers, the run's rewards
(engine.rewards) score them, each answer's advantage is its reward against its group's, and the adapter takes the
clipped policy step of TRL's GRPOTrainer with an optional KL penalty to the base model (grpo_loss holds the
arithmetic, grpo_sampling the sampling and the padded update batches, grpo_data the prompts).

A step takes ``grad_accum`` prompts: it samples ``group_size`` answers to each in one batch, scores them, and
trains on them one prompt's group per micro-batch, every normaliser counted over the whole step. With
``num_iterations`` above 1 the same answers serve that many steps (the sampling policy's log-probabilities kept,
so the ratio moves and the clip acts), and the data position waits for the next sampling. The base model's
log-probabilities for the KL penalty come from the same model with its adapter switched off: no second copy.

A checkpoint keeps no sampled group: a run resumed in the middle of ``num_iterations`` samples anew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import DataConfig, RunConfig
from engine.data.files import Example
from engine.events import AnswersSampled, Event, Notice, StepMetrics
from engine.method_facts import FACTS
from engine.rewards import Reward, RewardScores, build_rewards, score_completions
from engine.run.methods.base import HeldOut, StepTokens, TrainingMethod
from engine.run.methods.grpo_data import PromptData, PromptRow, prepare_prompts, read_prompts
from engine.run.methods.grpo_loss import ClipSettings, StepShape, group_advantages, masked_sum, step_loss, token_terms
from engine.run.methods.grpo_sampling import AnswerBatch, SampleSettings, answer_batch, answer_log_probs, sample_answers
from engine.run.session import Session
from engine.run.short_answers import pad_token, stop_token_ids
from engine.speed.stand_in import adapters_off

SHOWN_ANSWERS = 4
"""Sampled answers a step shows the user (AnswersSampled)."""


@dataclass
class GroupBatch:
    """One prompt's group as an update micro-batch: its padded tokens, which answer tokens count, and the
    log-probabilities fixed when it was sampled (the sampling policy's, the base model's)."""

    batch: AnswerBatch
    mask: torch.Tensor
    advantages: torch.Tensor
    old_log_probs: torch.Tensor | None = None
    base_log_probs: torch.Tensor | None = None


@dataclass
class Generation:
    """The answers one sampling made, and how many steps have trained on them."""

    groups: list[GroupBatch]
    scores: RewardScores
    shape: StepShape
    tokens: int
    """Prompt and answer tokens of the whole generation (what one update pass reads)."""
    answer_lengths: list[int]
    sampled_per_s: float | None
    shown: AnswersSampled | None = None
    """The first prompt's group as text with its rewards (step 0: set when a step reports it)."""
    uses: int = 0


@dataclass
class StepFigures:
    """The figures of the step just taken, for its StepMetrics."""

    scores: RewardScores
    completion_length: float
    kl: float | None
    clip_fraction: float
    generation_tokens_per_s: float | None
    update_tokens_per_s: float


@dataclass
class _Sums:
    kl: list[torch.Tensor] = field(default_factory=list)
    clipped: list[torch.Tensor] = field(default_factory=list)


class GrpoMethod(TrainingMethod):
    facts = FACTS["grpo"]

    def __init__(self) -> None:
        self.rewards: list[Reward] = []
        self.generation: Generation | None = None
        self.figures: StepFigures | None = None
        self.pad = 0
        self.stops: list[int] = []

    # data

    def prepare(self, config: DataConfig, tokenizer: Any, seed: int, extra_train: Sequence[Example] = ()) -> PromptData:
        return prepare_prompts(config, tokenizer, seed)

    def dataset_size(self, config: RunConfig, tokenizer: Any) -> tuple[int, int]:
        """(prompts, tokens): one prompt a row, so the automatic steps count prompts."""
        prompts = read_prompts(config.data.path, tokenizer)
        return len(prompts), math.ceil(len(prompts) * config.data.tokens_per_batch * 0.9)

    def longest_document(self, config: RunConfig, tokenizer: Any) -> int:
        """The longest prompt with the longest answer it may be given."""
        data = config.data
        prompts = read_prompts(data.path, tokenizer) + (
            read_prompts(data.eval_path, tokenizer) if data.eval_path else []
        )
        return max(len(p.input_ids) for p in prompts) + config.training.max_new_tokens

    def total_steps(self, config: RunConfig, rows: int) -> int:
        """Every sampling serves ``num_iterations`` steps."""
        return super().total_steps(config, rows) * (1 if config.training.max_steps else config.training.num_iterations)

    # the run

    def begin(self, session: Session) -> Iterator[Event]:
        training = session.config.training
        self.rewards = build_rewards(training.rewards)
        self.stops = stop_token_ids(session.tokenizer, session.model)
        self.pad = pad_token(session.tokenizer, self.stops)
        names = ", ".join(f"{reward.name} ×{reward.weight:g}" for reward in self.rewards)
        kl = f"KL penalty {training.kl_beta:g} to the base model" if training.kl_beta else "no KL penalty"
        yield Notice(
            f"GRPO: {training.group_size} answers to each of {training.grad_accum} prompt(s) a step, sampled at "
            f"temperature {training.temperature:g}, top-p {training.top_p:g}, up to {training.max_new_tokens} new "
            f"tokens; rewards {names}; {training.loss_type} loss, clip {training.epsilon:g}, {kl}; held-out "
            "prompts are scored by the mean reward of greedy answers"
        )

    def accumulate(self, session: Session, rows: list[int]) -> tuple[torch.Tensor, StepTokens]:
        training = session.config.training
        generation = self.generation
        if generation is None or generation.uses >= training.num_iterations:
            generation = self.generation = self._sample(session, rows)
        else:
            session.micro_batches -= len(rows)  # these prompts wait for the next sampling
        generation.uses += 1
        started = time.perf_counter()
        clip = _clip_settings(session.config)
        total = torch.zeros((), device=session.device)
        sums = _Sums()
        for group in generation.groups:
            log_probs = answer_log_probs(session.model, group.batch, training.temperature)
            old = group.old_log_probs if group.old_log_probs is not None else log_probs.detach()
            terms = token_terms(log_probs, old, group.base_log_probs, group.advantages, group.mask, clip)
            loss = step_loss(terms.loss, group.mask, training.loss_type, generation.shape)
            (session.scaler.scale(loss) if session.scaler is not None else loss).backward()
            total += loss.detach().float()
            if terms.kl is not None:
                sums.kl.append(torch.stack(masked_sum(terms.kl.detach(), group.mask)))
            sums.clipped.append(torch.stack(masked_sum(terms.clipped.float(), group.mask)))
        seconds = time.perf_counter() - started
        self.figures = _figures(generation, sums, seconds)
        trained = int(generation.shape.tokens)
        return total, StepTokens(generation.tokens, trained)

    def _sample(self, session: Session, rows: list[int]) -> Generation:
        """Sample, score and prepare the groups of the step's prompts."""
        data = _prompt_data(session)
        training = session.config.training
        prompts = [data.train_prompts[data.train_rows[r][0]] for r in rows]
        settings = SampleSettings(training.group_size, training.temperature, training.top_p, training.max_new_tokens)
        started = time.perf_counter()
        answers = sample_answers(session.model, [p.input_ids for p in prompts], settings, self.pad, self.stops)
        sampled_s = time.perf_counter() - started
        scores = self._score(session, prompts, answers, training.group_size)
        rewards = torch.tensor(scores.total, dtype=torch.float32, device=session.device)
        advantages, _ = group_advantages(rewards, training.group_size, training.scale_rewards)
        groups = [
            self._group(session, prompt, answers[i * settings.group : (i + 1) * settings.group], advantages, i)
            for i, prompt in enumerate(prompts)
        ]
        learned = int(sum(float(g.mask.sum()) for g in groups))
        shape = StepShape(len(answers), learned, training.max_new_tokens)
        tokens = sum(len(prompts[i // settings.group].input_ids) + len(a) for i, a in enumerate(answers))
        lengths = [len(a) for a in answers]
        per_s = sum(lengths) / sampled_s if sampled_s > 0 else None
        group = settings.group
        shown = AnswersSampled(
            0,
            prompts[0].text,
            [reward_text(session.tokenizer, a, self.stops) for a in answers[:group][:SHOWN_ANSWERS]],
            list(scores.total[:group][:SHOWN_ANSWERS]),
            {
                name: list(per[:group][:SHOWN_ANSWERS])
                for name, per in zip(scores.names, scores.per_reward, strict=True)
            },
        )
        return Generation(groups, scores, shape, tokens, lengths, per_s, shown)

    def _score(self, session: Session, prompts: list[PromptRow], answers: list[list[int]], group: int) -> RewardScores:
        repeated = [prompt for prompt in prompts for _ in range(group)]
        texts = [reward_text(session.tokenizer, answer, self.stops) for answer in answers]
        return score_completions(
            self.rewards, [p.text for p in repeated], texts, [p.fields for p in repeated], [p.number for p in repeated]
        )

    def _group(
        self, session: Session, prompt: PromptRow, answers: list[list[int]], advantages: torch.Tensor, index: int
    ) -> GroupBatch:
        training = session.config.training
        batch = answer_batch([prompt.input_ids] * len(answers), answers, self.pad, session.device)
        mask = batch.answer_mask
        if training.mask_truncated_completions:
            cut = torch.tensor([_truncated(a, self.stops, training.max_new_tokens) for a in answers])
            mask = mask * (~cut).to(mask.device).unsqueeze(1).to(mask.dtype)
        size = len(answers)
        group = GroupBatch(batch, mask, advantages[index * size : (index + 1) * size])
        if training.num_iterations > 1:
            group.old_log_probs = _fixed_log_probs(session, batch, adapter_on=True)
        if training.kl_beta:
            group.base_log_probs = _fixed_log_probs(session, batch, adapter_on=False)
        return group

    def reported(self, metrics: StepMetrics) -> StepMetrics:
        figures = self.figures
        if figures is None:
            return metrics
        total = torch.tensor(figures.scores.total, dtype=torch.float64)
        return dataclasses.replace(
            metrics,
            reward_mean=float(total.mean()),
            reward_std=float(total.std()) if total.numel() > 1 else 0.0,
            reward_means=figures.scores.means(),
            completion_length=figures.completion_length,
            kl=figures.kl,
            clip_fraction=figures.clip_fraction,
            generation_tokens_per_s=figures.generation_tokens_per_s,
            update_tokens_per_s=figures.update_tokens_per_s,
        )

    def after_step(self, step: int) -> Iterator[Event]:
        """A few answers of a new sampling, once, at the step that trained on them first."""
        generation = self.generation
        if generation is not None and generation.uses == 1 and generation.shown is not None:
            yield dataclasses.replace(generation.shown, step=step)

    def evaluate(self, session: Session) -> HeldOut | None:
        """The mean reward of greedy answers to the held-out prompts (greedy, so two evaluations compare the
        adapters, not the dice); the loss the best adapter is chosen by is its negative."""
        data = _prompt_data(session)
        if not data.eval_prompts:
            return None
        mean, tokens = held_out_reward(
            session.model, session.tokenizer, data.eval_prompts, self.rewards, session.config.training.max_new_tokens
        )
        return HeldOut(-mean, tokens, reward_mean=mean)


def held_out_reward(
    model: Any, tokenizer: Any, prompts: Sequence[PromptRow], rewards: Sequence[Reward], max_new_tokens: int
) -> tuple[float, int]:
    """(mean total reward, answer tokens) of the model's greedy answers to ``prompts``, as it is (the caller
    switches adapters)."""
    stops = stop_token_ids(tokenizer, model)
    settings = SampleSettings(1, 1.0, 1.0, max_new_tokens)
    answers = sample_answers(model, [p.input_ids for p in prompts], settings, pad_token(tokenizer, stops), stops, True)
    texts = [reward_text(tokenizer, answer, stops) for answer in answers]
    scores = score_completions(
        rewards, [p.text for p in prompts], texts, [p.fields for p in prompts], [p.number for p in prompts]
    )
    return sum(scores.total) / len(scores.total), sum(len(a) for a in answers)


def reward_text(tokenizer: Any, answer: Sequence[int], stops: Sequence[int]) -> str:
    """The answer as the rewards read it: its tokens before the end token, special tokens left out, nothing
    stripped (TRL's completion text; a reward that wants it trimmed trims it)."""
    kept = answer[:-1] if answer and answer[-1] in set(stops) else answer
    text: str = tokenizer.decode(list(kept), skip_special_tokens=True)
    return text


def _prompt_data(session: Session) -> PromptData:
    data = session.data
    assert isinstance(data, PromptData), "a GRPO run prepares its prompts with GrpoMethod.prepare"
    return data


def _clip_settings(config: RunConfig) -> ClipSettings:
    training = config.training
    high = training.epsilon_high if training.epsilon_high is not None else training.epsilon
    return ClipSettings(training.epsilon, high, training.kl_beta, training.importance_sampling_level)


def _truncated(answer: Sequence[int], stops: Sequence[int], max_new_tokens: int) -> bool:
    """An answer cut at max new tokens: it never reached an end token."""
    return len(answer) >= max_new_tokens and (not answer or answer[-1] not in set(stops))


@torch.no_grad()
def _fixed_log_probs(session: Session, batch: AnswerBatch, adapter_on: bool) -> torch.Tensor:
    """The answer tokens' log-probabilities with the adapter as it is now (the sampling policy) or switched off (the
    base model), in eval mode without gradients."""
    model = session.model
    training = model.training
    model.eval()
    try:
        with contextlib.nullcontext() if adapter_on else adapters_off(model):
            return answer_log_probs(model, batch, session.config.training.temperature)
    finally:
        model.train(training)


def _figures(generation: Generation, sums: _Sums, seconds: float) -> StepFigures:
    kl = None
    if sums.kl:
        kl_total = torch.stack(sums.kl).sum(0)
        kl = float(kl_total[0] / kl_total[1].clamp(min=1.0))
    clipped = torch.stack(sums.clipped).sum(0)
    lengths = generation.answer_lengths
    return StepFigures(
        generation.scores,
        sum(lengths) / max(len(lengths), 1),
        kl,
        float(clipped[0] / clipped[1].clamp(min=1.0)),
        generation.sampled_per_s if generation.uses == 1 else None,
        generation.tokens / seconds if seconds > 0 else 0.0,
    )
