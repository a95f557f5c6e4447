"""The built-in demo: a date-normalisation task, its files, and an exact-match accuracy measure.

TuneDeck ships a tiny base model (made by ``scripts/build_demo.py``, a few MB) that has read plenty of dates in
many formats but has never been asked to rewrite one. The demo dataset asks exactly that ("Convert to ISO date:
March 5, 2021" -> "2021-03-05"), so ``tunedeck train --demo`` shows a task go from almost no answer right to most
answers right in about a minute on a laptop CPU. The task is checkable by exact match, so "accuracy before ->
after" needs no judge. Everything here is Qt-free and deterministic from a seed.
"""

from __future__ import annotations

import datetime as dt
import random
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    GenerativeModel = PreTrainedModel | PeftModel


Row = dict[str, Any]
"""One chat row: ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}``."""

DEMO_DIR = Path(str(resources.files("resources"))) / "demo"
DEMO_MODEL_DIR = DEMO_DIR / "model"
DEMO_TRAIN_FILE = DEMO_DIR / "data" / "train.jsonl"
DEMO_EVAL_FILE = DEMO_DIR / "data" / "eval.jsonl"

MONTHS = (
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
)  # fmt: skip
MONTH_ABBREVIATIONS = tuple(name[:3] for name in MONTHS)

# Years of the task: wide enough that the model must copy digits rather than memorise a few years.
FIRST_YEAR = 1900
LAST_YEAR = 2099


def ordinal(day: int) -> str:
    """``1`` -> ``"1st"``, ``12`` -> ``"12th"``, ``23`` -> ``"23rd"`` (English ordinal suffixes)."""
    suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def iso_date(date: dt.date) -> str:
    """The answer form, ``YYYY-MM-DD``, written by hand so it never depends on the locale."""
    return f"{date.year:04d}-{date.month:02d}-{date.day:02d}"


# The surface forms a user may type. Numeric forms carry their order, since 05/03 is ambiguous on its own.
DATE_STYLES: Mapping[str, Callable[[dt.date], str]] = {
    "month_day_year": lambda d: f"{MONTHS[d.month - 1]} {d.day}, {d.year}",
    "day_month_year": lambda d: f"{d.day} {MONTHS[d.month - 1]} {d.year}",
    "abbreviated": lambda d: f"{MONTH_ABBREVIATIONS[d.month - 1]} {d.day} {d.year}",
    "abbreviated_comma": lambda d: f"{MONTH_ABBREVIATIONS[d.month - 1]} {d.day}, {d.year}",
    "ordinal": lambda d: f"{ordinal(d.day)} {MONTHS[d.month - 1]} {d.year}",
    "numeric_day_first": lambda d: f"{d.day:02d}/{d.month:02d}/{d.year} (day first)",
    "numeric_month_first": lambda d: f"{d.month:02d}/{d.day:02d}/{d.year} (month first)",
}

PROMPT_TEMPLATES = (
    "Convert to ISO date: {date}",
    "Write this date as YYYY-MM-DD: {date}",
    "What is {date} in ISO format?",
    "Normalize the date {date}",
)


def format_date(date: dt.date, style: str) -> str:
    """``date`` written in one of :data:`DATE_STYLES` (or ``"iso"``)."""
    if style == "iso":
        return iso_date(date)
    return DATE_STYLES[style](date)


def random_date(rng: random.Random) -> dt.date:
    """A uniformly drawn day between :data:`FIRST_YEAR` and :data:`LAST_YEAR`."""
    first = dt.date(FIRST_YEAR, 1, 1).toordinal()
    last = dt.date(LAST_YEAR, 12, 31).toordinal()
    return dt.date.fromordinal(rng.randint(first, last))


def make_demo_row(date: dt.date, rng: random.Random) -> Row:
    """One chat row asking for ``date`` in ISO form, in a random surface style and phrasing."""
    style = rng.choice(sorted(DATE_STYLES))
    prompt = rng.choice(PROMPT_TEMPLATES).format(date=format_date(date, style))
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": iso_date(date)}]}


def make_demo_examples(n: int, seed: int) -> list[Row]:
    """``n`` demo rows, each about a different day, deterministic from ``seed``.

    Days never repeat within one call, so slicing one call into train and eval gives an eval set whose dates
    the fine-tune has never seen (it must learn the rule, not memorise answers).
    """
    days = dt.date(LAST_YEAR, 12, 31).toordinal() - dt.date(FIRST_YEAR, 1, 1).toordinal() + 1
    if not 0 <= n <= days:
        raise ValueError(f"n must be between 0 and {days} (one row per day), got {n}")
    rng = random.Random(seed)
    seen: set[dt.date] = set()
    rows: list[Row] = []
    while len(rows) < n:
        date = random_date(rng)
        if date in seen:
            continue
        seen.add(date)
        rows.append(make_demo_row(date, rng))
    return rows


def _input_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _left_padded(prompts: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into (ids, attention mask) so every row's next token is at the same column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt) :] = 1
    return ids, mask


def prompt_ids(tokenizer: PreTrainedTokenizerBase, row: Row) -> list[int]:
    """Token ids of a row's conversation without its final (assistant) turn, ending with the generation prompt."""
    text = tokenizer.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, tokenize=False)
    return list(tokenizer(str(text), add_special_tokens=False)["input_ids"])


@torch.inference_mode()
def generate_answers(
    model: GenerativeModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Row],
    max_new_tokens: int = 16,
    batch_size: int = 64,
) -> list[str]:
    """Greedy answers of ``model`` to each row's prompt, batched with left padding and a KV cache.

    Works on a plain model and on a peft ``PeftModel``; the model's train/eval mode is restored afterwards so
    this can run in the middle of a fine-tune.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    answers: list[str] = []
    try:
        for start in range(0, len(rows), batch_size):
            prompts = [prompt_ids(tokenizer, row) for row in rows[start : start + batch_size]]
            answers.extend(_generate_batch(model, tokenizer, prompts, pad_id, max_new_tokens))
    finally:
        model.train(was_training)
    return answers


def _generate_batch(
    model: GenerativeModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[list[int]],
    pad_id: int,
    max_new_tokens: int,
) -> list[str]:
    ids, mask = _left_padded(prompts, pad_id)
    device = _input_device(model)
    # Type checkers see ``generate`` through nn.Module.__getattr__ (peft forwards it, transformers wraps it).
    generate = cast(Callable[..., torch.Tensor], model.generate)
    out = generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    new_tokens = out[:, ids.shape[1] :].tolist()
    return [str(tokenizer.decode(tokens, skip_special_tokens=True)).strip() for tokens in new_tokens]


def reference_answer(row: Row) -> str:
    """The expected answer of a row: its last (assistant) message, stripped."""
    return str(row["messages"][-1]["content"]).strip()


def evaluate_accuracy(
    model: GenerativeModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[Row],
    max_new_tokens: int = 16,
    batch_size: int = 64,
) -> float:
    """Share of ``rows`` whose greedy answer equals the reference answer exactly (after stripping whitespace)."""
    if not rows:
        raise ValueError("cannot measure accuracy on zero rows")
    answers = generate_answers(model, tokenizer, rows, max_new_tokens=max_new_tokens, batch_size=batch_size)
    correct = sum(answer == reference_answer(row) for answer, row in zip(answers, rows, strict=True))
    return correct / len(rows)
