"""GRPO's data: prompts, each a ``prompt`` string or ``messages`` that end in a user turn, with any other columns
(a reference ``answer``, say) handed to the rewards as the row's fields.

A text prompt is tokenized as it is and a message list through the chat template with the assistant turn opened,
as TRL does. A bad row stops the run before the model loads, with its row number and what is wrong with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.config import DataConfig
from engine.data.files import read_rows
from engine.data.packing import IGNORE_INDEX, TokenizedExample
from engine.data.prepare import PreparedData
from engine.data.split import split_examples
from engine.data.tokenize import ensure_chat_template
from engine.errors import DataError

PROMPT_HINT = (
    "each row needs a 'prompt' string, or 'messages' (a list of {role, content}) that ends with a user turn; "
    "other columns (such as 'answer') are handed to the rewards"
)


@dataclass(frozen=True)
class PromptRow:
    """One prompt of the data: its row number (1-based), the text the rewards see, the other columns, its tokens."""

    number: int
    text: str
    fields: Mapping[str, Any]
    input_ids: tuple[int, ...]


@dataclass
class PromptData(PreparedData):
    """Prepared GRPO data: one prompt a row (``train``/``eval`` hold its tokens, none learned from), and the
    prompts themselves."""

    train_prompts: list[PromptRow] = field(default_factory=list)
    eval_prompts: list[PromptRow] = field(default_factory=list)


def read_prompts(path: str, tokenizer: Any) -> list[PromptRow]:
    """Every row of ``path`` as a prompt; the first bad row raises a DataError naming it."""
    ensure_chat_template(tokenizer)
    rows = read_rows(path)
    if not rows:
        raise DataError("no prompts: the file has no rows", path=path, hint=PROMPT_HINT)
    return [_prompt(row, number, path, tokenizer) for number, row in enumerate(rows, start=1)]


def _prompt(row: Any, number: int, path: str, tokenizer: Any) -> PromptRow:
    if not isinstance(row, dict):
        raise DataError(f"must be an object, got {type(row).__name__}", path=path, row=number, hint=PROMPT_HINT)
    fields = {key: value for key, value in row.items() if key not in ("prompt", "messages")}
    if row.get("prompt") is not None:
        text = row["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise DataError("must be a non-empty string", path=path, row=number, field="prompt", hint=PROMPT_HINT)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return PromptRow(number, text, fields, tuple(ids))
    if row.get("messages") is None:
        raise DataError("has no 'prompt' and no 'messages'", path=path, row=number, hint=PROMPT_HINT)
    messages = _messages(row["messages"], number, path)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # tokenizers that return a BatchEncoding
        ids = ids["input_ids"]
    return PromptRow(number, messages[-1]["content"], fields, tuple(int(i) for i in ids))


def _messages(raw: Any, number: int, path: str) -> list[dict[str, str]]:
    """A message list that ends with the user's turn (the answer is what the model samples)."""
    if not isinstance(raw, list) or not raw:
        raise DataError("must be a non-empty list of messages", path=path, row=number, field="messages")
    messages = []
    for place, item in enumerate(raw, start=1):
        if not isinstance(item, dict) or not isinstance(item.get("content"), str) or not item.get("role"):
            raise DataError(
                "must be an object with a 'role' and a 'content' string", path=path, row=number,
                field=f"messages[{place}]",
            )  # fmt: skip
        messages.append({"role": str(item["role"]), "content": item["content"]})
    if messages[-1]["role"] != "user":
        raise DataError(
            f"must end with a user turn, ends with {messages[-1]['role']!r}",
            path=path,
            row=number,
            field="messages",
            hint="GRPO samples the answer: leave the assistant's last turn out",
        )
    return messages


def prepare_prompts(config: DataConfig, tokenizer: Any, seed: int) -> PromptData:
    """The run's prompts, split into training and held-out ones with the run's seed (or ``eval_path``'s)."""
    if not config.path:
        raise DataError("no dataset given", hint="pass --data PATH (a .jsonl/.json/.csv/.parquet file of prompts)")
    prompts = read_prompts(config.path, tokenizer)
    if config.eval_path:
        train, held_out = prompts, read_prompts(config.eval_path, tokenizer)
    else:
        train, held_out = split_examples(prompts, config.eval_fraction, seed)
    notices = []
    longest = config.max_seq_len
    if longest:
        kept = [p for p in train if len(p.input_ids) <= longest]
        if len(kept) < len(train):
            notices.append(f"{len(train) - len(kept)} prompt(s) longer than {longest} tokens were left out")
        train, held_out = kept, [p for p in held_out if len(p.input_ids) <= longest]
    if not train:
        raise DataError("no usable prompts are left", path=config.path)
    return PromptData(
        train=_as_examples(train),
        eval=_as_examples(held_out),
        train_rows=[[i] for i in range(len(train))],
        eval_rows=[[i] for i in range(len(held_out))],
        data_format="prompts",
        efficiency=1.0,
        notices=notices,
        train_prompts=train,
        eval_prompts=held_out,
    )


def _as_examples(prompts: Sequence[PromptRow]) -> list[TokenizedExample]:
    """Each prompt's tokens, none learned from (its answers are sampled)."""
    return [TokenizedExample(p.input_ids, (IGNORE_INDEX,) * len(p.input_ids)) for p in prompts]
