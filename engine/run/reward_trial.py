"""Trying rewards before training: the base model answers the first few prompts of the dataset and every chosen
reward scores each answer.

Training by reward learns only from differences between the answers to one prompt: a reward that gives every
answer of the base model 0 (or every answer 1) leaves nothing to learn. Seeing the base model's answers scored,
before a run, shows whether the rewards tell answers apart and whether a regular expression or a reference column
does what the user meant. The answers are greedy (the model's most likely answer, the same on every try), so a
change of reward alone changes the scores; a run samples, so its answers vary around these.

A prompt row has a ``prompt`` string or ``messages`` ending in a user turn; the rewards see that turn's text as
the prompt and the whole row as ``row``. The model is loaded for the trial and let go after it, so it holds no
memory that a run will need.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.data.files import read_rows
from engine.errors import DataError
from engine.model.chat import ChatModel, load_base_chat_model, prompt_ids
from engine.rewards import Reward, RewardScores, RewardSpec, build_rewards, score_completions
from engine.run.short_answers import answer_text, greedy_continuations, pad_token, stop_token_ids

TRIAL_PROMPTS = 4
TRIAL_NEW_TOKENS = 96
"""An answer stops at this many new tokens: long enough for a short worked answer, short enough for a CPU."""


@dataclass(frozen=True)
class TrialPrompt:
    """One prompt row of the dataset, ready to answer."""

    row_number: int
    """The row's number in the file, from 1 (as data errors count them)."""
    messages: tuple[dict[str, str], ...]
    """The conversation the model answers, ending in the user's turn."""
    row: Mapping[str, Any]

    @property
    def prompt(self) -> str:
        return self.messages[-1]["content"]


@dataclass(frozen=True)
class RewardTrial:
    """The base model's answers to the trial prompts and every reward's score of each."""

    prompts: tuple[TrialPrompt, ...]
    answers: tuple[str, ...]
    scores: RewardScores


def prompt_messages(row: Mapping[str, Any]) -> tuple[dict[str, str], ...] | None:
    """The conversation a prompt row asks the model to continue: its ``prompt`` as a user turn, or its
    ``messages`` when they end in a user turn; None for a row that is not a prompt."""
    prompt, messages = row.get("prompt"), row.get("messages")
    if isinstance(prompt, str) and prompt.strip():
        return ({"role": "user", "content": prompt},)
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        turns = tuple({"role": str(m.get("role", "")), "content": str(m.get("content", ""))} for m in messages)
        return turns if turns[-1]["role"] == "user" and turns[-1]["content"].strip() else None
    return None


def trial_prompts(rows: Sequence[Mapping[str, Any]], limit: int = TRIAL_PROMPTS) -> list[TrialPrompt]:
    """The first ``limit`` prompt rows; a DataError when the data has none."""
    found: list[TrialPrompt] = []
    for number, row in enumerate(rows, start=1):
        messages = prompt_messages(row)
        if messages is not None:
            found.append(TrialPrompt(number, messages, row))
        if len(found) == limit:
            break
    if not found:
        raise DataError(
            "no prompt rows to try the rewards on",
            hint="rows need a 'prompt' string, or 'messages' ending in a user turn",
        )
    return found


@torch.no_grad()
def answer_prompts(chat: ChatModel, prompts: Sequence[TrialPrompt], new_tokens: int = TRIAL_NEW_TOKENS) -> list[str]:
    """Each prompt's greedy answer from the model as loaded, in one left-padded batch."""
    stops = stop_token_ids(chat.tokenizer, chat.model)
    ids = [prompt_ids(chat, list(p.messages))[0].tolist() for p in prompts]
    made = greedy_continuations(chat.model, ids, chat.device, pad_token(chat.tokenizer, stops), stops, new_tokens)
    return [answer_text(chat.tokenizer, tokens, stops) for tokens in made]


def score_trial(chat: ChatModel, prompts: Sequence[TrialPrompt], rewards: Sequence[Reward]) -> RewardTrial:
    """The model's answers to ``prompts`` and the rewards' scores of them."""
    answers = answer_prompts(chat, prompts)
    scores = score_completions(
        rewards, [p.prompt for p in prompts], answers, [p.row for p in prompts], [p.row_number for p in prompts]
    )
    return RewardTrial(tuple(prompts), tuple(answers), scores)


def try_rewards(
    model_name: str, data_path: str, specs: Sequence[RewardSpec], *, limit: int = TRIAL_PROMPTS, device: str = "auto"
) -> RewardTrial:
    """Load the base model, answer the dataset's first ``limit`` prompts, score the answers, let the model go.
    The rewards are built and the prompts read first, so a bad reward or dataset fails before the model loads."""
    rewards = build_rewards(specs)
    prompts = trial_prompts(read_rows(data_path), limit)
    chat = load_base_chat_model(model_name, device)
    try:
        return score_trial(chat, prompts, rewards)
    finally:
        del chat
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
