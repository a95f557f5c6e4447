"""Exact match and token F1 of short answers: does the tuned model now say what the held-out examples say?

Loss and perplexity tell how likely the held-out answers are; for data with short answers (a label, a date, a
name) a user also wants to know how often the model *says* the answer. A held-out example's answer is its last
run of learned tokens (the final assistant turn, or a completion) and its prompt everything before it; examples
whose answer is at most :data:`SHORT_ANSWER_TOKENS` tokens are answered greedily from their prompt, the first
:data:`MAX_EXAMPLES` of them, each with at most its answer's length plus :data:`EXTRA_NEW_TOKENS` new tokens, in
left-padded batches: on a CPU, 30 answers of ~10 tokens cost a few dozen forward passes per column, not a
second model. The answer and the reply are compared as SQuAD does: lower case, punctuation and the articles
a/an/the removed, whitespace collapsed; exact match is 1 or 0 per example, token F1 the harmonic mean of the
precision and recall of their shared words. Examples trained on all their tokens have no prompt and are left out.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.data.packing import IGNORE_INDEX, TokenizedExample

SHORT_ANSWER_TOKENS = 32
"""An answer of at most this many tokens (its end-of-turn tokens included) is short enough to score by matching."""
MAX_EXAMPLES = 30
"""At most this many held-out examples are answered per column, so the report stays cheap on a CPU."""
EXTRA_NEW_TOKENS = 8
"""A reply may run this many tokens past its reference answer's length (a longer one cannot match anyway)."""
BATCH_SIZE = 8
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>", "<|endoftext|>")
"""End-of-turn markers of common chat templates: a reply and an answer end at the first one."""


@dataclass(frozen=True)
class ShortAnswer:
    """One held-out example split for answering: the prompt's tokens and the reference answer's."""

    prompt: tuple[int, ...]
    answer: tuple[int, ...]


@dataclass(frozen=True)
class AnswerScores:
    exact_match: float
    """The share of replies equal to their answer once normalised."""
    token_f1: float
    """The mean token F1 of reply against answer."""


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD's token F1; two answers without words agree only when both are empty."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not predicted or not expected:
        return float(predicted == expected)
    shared = sum((Counter(predicted) & Counter(expected)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(predicted), shared / len(expected)
    return 2 * precision * recall / (precision + recall)


def split_answer(example: TokenizedExample) -> ShortAnswer | None:
    """The example's last run of learned tokens as its answer, the tokens before it as its prompt; None when it
    has no prompt (trained on every token) or nothing learned."""
    trained = [i for i, label in enumerate(example.labels) if label != IGNORE_INDEX]
    if not trained:
        return None
    end = trained[-1] + 1
    start = end
    while start > 0 and example.labels[start - 1] != IGNORE_INDEX:
        start -= 1
    if start == 0:
        return None
    return ShortAnswer(example.input_ids[:start], example.input_ids[start:end])


def short_answers(
    held_out: Sequence[TokenizedExample], limit: int = MAX_EXAMPLES, max_tokens: int = SHORT_ANSWER_TOKENS
) -> tuple[list[ShortAnswer], str]:
    """The first ``limit`` held-out examples with a prompt and an answer of at most ``max_tokens`` tokens, and a
    sentence saying which were scored (or why none could be)."""
    if not held_out:
        return [], "not scored: the run has no held-out examples"
    split = [answer for answer in map(split_answer, held_out) if answer is not None]
    if not split:
        return [], "not scored: the held-out examples have no prompt apart from their answer (trained on all tokens)"
    short = [answer for answer in split if len(answer.answer) <= max_tokens]
    if not short:
        return [], f"not scored: none of the {len(split)} held-out answers is {max_tokens} tokens or shorter"
    chosen = short[:limit]
    first = f"the first {len(chosen)} of " if len(chosen) < len(short) else ""
    return chosen, (
        f"scored on {first}{len(short)} held-out examples whose answer is at most {max_tokens} tokens (of "
        f"{len(held_out)} held out), answered greedily"
    )


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """The tokens that end a reply: the tokenizer's end of text, the model's own, and known end-of-turn tokens."""
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    unknown = tokenizer.unk_token_id
    for marker in END_MARKERS:
        found = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(found, int) and found != unknown and found >= 0:
            ids.add(found)
    return sorted(ids)


def answer_text(tokenizer: Any, ids: Sequence[int], stops: Sequence[int]) -> str:
    """The text of ``ids`` up to the first end token or end-of-turn marker, without special tokens."""
    stop_set = set(stops)
    ends = [i for i, token in enumerate(ids) if token in stop_set]
    kept = list(ids[: ends[0]] if ends else ids)
    text: str = tokenizer.decode(kept, skip_special_tokens=True)
    for marker in (tokenizer.eos_token, *END_MARKERS):
        if marker and marker in text:  # a template whose end-of-turn is plain text, not one token
            text = text[: text.index(marker)]
    return text.strip()


def pad_token(tokenizer: Any, stops: Sequence[int]) -> int:
    """The token left-padded batches are padded with: the tokenizer's own, else an end token."""
    return int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else (stops[0] if stops else 0)


@torch.no_grad()
def greedy_continuations(
    model: Any, prompts: Sequence[Sequence[int]], device: torch.device, pad: int, stops: Sequence[int], new: int
) -> list[list[int]]:
    """Each prompt's greedy continuation of at most ``new`` tokens, ending at any of ``stops``: the prompts as one
    left-padded batch, with the KV cache (the model as it is: the caller switches the adapter)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    output = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        use_cache=True,
        eos_token_id=list(stops) or None,
        pad_token_id=pad,
    )
    return [row[width:].tolist() for row in output]


def generate_replies(
    model: Any, tokenizer: Any, answers: Sequence[ShortAnswer], device: torch.device, stops: Sequence[int]
) -> list[str]:
    """Each prompt's greedy reply, ending at any of ``stops`` (the model as it is: the caller switches the
    adapter)."""
    pad = pad_token(tokenizer, stops)
    replies: list[str] = []
    for start in range(0, len(answers), BATCH_SIZE):
        batch = answers[start : start + BATCH_SIZE]
        new = max(len(a.answer) for a in batch) + EXTRA_NEW_TOKENS
        made = greedy_continuations(model, [a.prompt for a in batch], device, pad, stops, new)
        replies += [answer_text(tokenizer, ids, stops) for ids in made]
    return replies


def score_replies(
    tokenizer: Any, answers: Sequence[ShortAnswer], replies: Sequence[str], stops: Sequence[int]
) -> AnswerScores:
    """Exact match and token F1 of ``replies`` against the answers (both averaged over the examples)."""
    references = [answer_text(tokenizer, a.answer, stops) for a in answers]
    pairs = list(zip(replies, references, strict=True))
    count = max(len(pairs), 1)
    return AnswerScores(sum(exact_match(p, r) for p, r in pairs) / count, sum(token_f1(p, r) for p, r in pairs) / count)


def answer_scores(model: Any, tokenizer: Any, answers: Sequence[ShortAnswer], device: torch.device) -> AnswerScores:
    """Generate the replies and score them."""
    stops = stop_token_ids(tokenizer, model)
    return score_replies(tokenizer, answers, generate_replies(model, tokenizer, answers, device, stops), stops)
