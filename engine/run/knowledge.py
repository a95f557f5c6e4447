"""The knowledge check: does the tuned model still know the facts its base model knew?

The perplexity of a general text barely moves when a small model forgets facts: a tuned 135M model once lost most
of the answers its base knew while reading the text as well as before. This check asks the questions shipped in
``resources/knowledge/questions.jsonl`` (a few hundred short general-knowledge questions written for TuneDeck,
each with a one-to-three-word answer and its accepted spellings) through the model's own chat template, each
followed by :data:`INSTRUCTION`, and reads the greedy replies. A reply is right when, normalised, it contains the
answer or an accepted variant as whole words (numbers compared as numbers). :func:`compare` then says how many of
the questions the base model got right are still right after tuning ("kept K of B"), and how many are newly right.

The model is used as the caller hands it over: a peft model answers with its active adapter, or as its base inside
``model.disable_adapter()``; nothing is loaded here. Questions are asked in left-padded batches sorted by prompt
length, with the KV cache and at most :data:`MAX_NEW_TOKENS` new tokens: one column of SmolLM2-135M-Instruct
(float32, two CPU cores) costs about half a minute.
"""

from __future__ import annotations

import dataclasses
import json
import re
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.data.tokenize import CHATML_TEMPLATE
from engine.run.short_answers import answer_text, greedy_continuations, pad_token, stop_token_ids

INSTRUCTION = "Answer in a few words."
"""Put after each question: SmolLM2-135M-Instruct then answers in a short phrase that ends its turn."""
MAX_NEW_TOKENS = 12
"""A reply is cut after this many tokens: enough for "The capital of France is Paris.", and an answer that has not
appeared by then is not a short answer."""
BATCH_SIZE = 16
"""Questions answered together; a batch of similar-length prompts wastes little on padding."""
KEPT_WARNING = 0.90
"""Below this share of the base model's right answers still right after tuning, the verdict warns."""

Cancelled = Callable[[], bool]
"""Asked before each batch: True stops the check with :class:`KnowledgeCancelled`."""


def never() -> bool:
    return False


class KnowledgeCancelled(Exception):
    """The check was stopped before its end."""


@dataclass(frozen=True)
class Question:
    """One question of the set, with its answer and the other spellings accepted for it."""

    id: str
    domain: str
    question: str
    answer: str
    accept: tuple[str, ...] = ()

    def answers(self) -> tuple[str, ...]:
        """The answer first, then the accepted variants."""
        return (self.answer, *self.accept)


def questions_file() -> Path:
    import resources

    return Path(resources.__file__).parent / "knowledge" / "questions.jsonl"


def load_questions(path: Path | None = None) -> tuple[Question, ...]:
    """The question set in file order (the shipped one unless ``path`` names another JSONL file)."""
    rows = (path or questions_file()).read_text(encoding="utf-8").splitlines()
    return tuple(_question(json.loads(row)) for row in rows if row.strip())


def _question(row: dict[str, Any]) -> Question:
    return Question(row["id"], row["domain"], row["question"], row["answer"], tuple(row.get("accept", ())))


# ------------------------------------------------------------------------------------------------ scoring


def _number(word: str) -> str:
    """A numeral as its value's plain spelling ("4.0" -> "4", "3.140" -> "3.14"); any other word as it is."""
    if not re.fullmatch(r"\d+(\.\d+)?", word):
        return word
    value = float(word)
    return str(int(value)) if value.is_integer() else repr(value)


def normalize_words(text: str) -> tuple[str, ...]:
    """``text`` as lower-case words without accents or punctuation, numerals as numbers: thousands separators go
    ("1,000" is 1000), a decimal point stays, and digits split from letters ("100C" is 100 c, "H2O" is h 2 o)."""
    text = unicodedata.normalize("NFKD", text.lower())
    text = "".join(ch for ch in text if not unicodedata.combining(ch))
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    text = re.sub(r"(?<!\d)\.|\.(?!\d)", " ", text)
    text = re.sub(r"[^\w.]+|_", " ", text)
    text = re.sub(r"(?<=\d)(?=[^\W\d])|(?<=[^\W\d])(?=\d)", " ", text)
    return tuple(_number(word) for word in text.split())


def _contains(words: Sequence[str], phrase: Sequence[str]) -> bool:
    size = len(phrase)
    return size > 0 and any(tuple(words[i : i + size]) == tuple(phrase) for i in range(len(words) - size + 1))


def is_right(reply: str, answers: Sequence[str]) -> bool:
    """Whether the reply holds any of ``answers`` as whole words: "Paris." and "It is Paris" hold "Paris",
    "Parisian" does not; "4.0" holds "4"."""
    words = normalize_words(reply)
    return any(_contains(words, normalize_words(answer)) for answer in answers)


@dataclass(frozen=True)
class Answered:
    """One question's reply and whether it was right."""

    id: str
    domain: str
    reply: str
    right: bool


@dataclass(frozen=True)
class KnowledgeScores:
    """One model's answers to the question set, in the set's order."""

    answers: tuple[Answered, ...]

    @property
    def right(self) -> int:
        return sum(a.right for a in self.answers)

    @property
    def total(self) -> int:
        return len(self.answers)

    def right_ids(self) -> frozenset[str]:
        return frozenset(a.id for a in self.answers if a.right)

    def by_domain(self) -> dict[str, tuple[int, int]]:
        """domain -> (right, asked), domains in the set's order."""
        counts: dict[str, tuple[int, int]] = {}
        for a in self.answers:
            right, asked = counts.get(a.domain, (0, 0))
            counts[a.domain] = (right + a.right, asked + 1)
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {"answers": [dataclasses.asdict(a) for a in self.answers]}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KnowledgeScores:
        return cls(tuple(Answered(**a) for a in raw["answers"]))


def score(questions: Sequence[Question], replies: Sequence[str]) -> KnowledgeScores:
    """The replies to ``questions`` (in order) marked right or wrong."""
    pairs = zip(questions, replies, strict=True)
    return KnowledgeScores(tuple(Answered(q.id, q.domain, r, is_right(r, q.answers())) for q, r in pairs))


# ------------------------------------------------------------------------------------------------ comparing


@dataclass(frozen=True)
class KnowledgeKept:
    """What a tuned model kept of what its base model knew."""

    asked: int
    """Questions asked of both models."""
    base_right: int
    """B: questions the base model got right."""
    kept: int
    """K: of those, the ones the tuned model still gets right."""
    newly_right: int
    """N: questions the tuned model gets right and the base model did not."""
    lost: tuple[str, ...]
    """Ids of the questions the base model got right and the tuned model no longer does, in the set's order."""

    @property
    def kept_share(self) -> float | None:
        """K / B; None when the base model got nothing right (nothing could be lost)."""
        return self.kept / self.base_right if self.base_right else None

    @property
    def warns(self) -> bool:
        share = self.kept_share
        return share is not None and share < KEPT_WARNING

    def verdict(self) -> str:
        """One line: "kept 58 of 64 facts the base model knew (91%), 3 newly right: little lost"."""
        share = self.kept_share
        if share is None:
            return f"knowledge check: the base model answered none of {self.asked} questions right, nothing to lose"
        words = f"under {KEPT_WARNING:.0%}: it lost knowledge its base model had" if self.warns else "little lost"
        if self.kept == self.base_right:
            words = "nothing lost"
        return (
            f"kept {self.kept} of {self.base_right} facts the base model knew ({share:.0%}), "
            f"{self.newly_right} newly right: {words}"
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> KnowledgeKept:
        return cls(**{**raw, "lost": tuple(raw["lost"])})


def compare(base: KnowledgeScores, tuned: KnowledgeScores) -> KnowledgeKept:
    """How much of the base model's knowledge the tuned model kept; both must have answered the same questions."""
    if [a.id for a in base.answers] != [a.id for a in tuned.answers]:
        raise ValueError("the base and tuned models answered different questions")
    known, now = base.right_ids(), tuned.right_ids()
    lost = tuple(a.id for a in base.answers if a.id in known and a.id not in now)
    return KnowledgeKept(base.total, len(known), len(known) - len(lost), len(now - known), lost)


# ------------------------------------------------------------------------------------------------ asking


def prompt_ids(tokenizer: Any, question: Question, instruction: str = INSTRUCTION) -> list[int]:
    """The question and instruction as one user turn in the model's chat template (ChatML when it has none),
    ending where the assistant speaks."""
    template = None if getattr(tokenizer, "chat_template", None) else CHATML_TEMPLATE
    content = f"{question.question} {instruction}".strip()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True, chat_template=template
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def ask(
    model: Any,
    tokenizer: Any,
    device: torch.device,
    questions: Sequence[Question] | None = None,
    batch_size: int = BATCH_SIZE,
    max_new_tokens: int = MAX_NEW_TOKENS,
    cancelled: Cancelled = never,
    instruction: str = INSTRUCTION,
) -> KnowledgeScores:
    """Ask ``questions`` (the shipped set by default) of the model as it is and score its greedy replies.

    Prompts are batched by length (shortest first) so batches pad little; the replies come back in the questions'
    order. ``cancelled`` is asked before each batch. The model is put in eval mode for the check and back after.
    """
    chosen = tuple(load_questions() if questions is None else questions)
    stops = stop_token_ids(tokenizer, model)
    pad = pad_token(tokenizer, stops)
    prompts = [prompt_ids(tokenizer, q, instruction) for q in chosen]
    order = sorted(range(len(chosen)), key=lambda i: len(prompts[i]))
    replies = [""] * len(chosen)
    training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            if cancelled():
                raise KnowledgeCancelled("the knowledge check was stopped before its end")
            batch = order[start : start + batch_size]
            made = greedy_continuations(model, [prompts[i] for i in batch], device, pad, stops, max_new_tokens)
            for index, ids in zip(batch, made, strict=True):
                replies[index] = answer_text(tokenizer, ids, stops)
    finally:
        model.train(training)
    return score(chosen, replies)
