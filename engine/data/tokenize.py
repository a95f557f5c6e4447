"""Rendering examples to tokens, with labels only where the model should learn.

Chats are rendered with the tokenizer's own chat template (a built-in ChatML one when it has none). Which
tokens belong to assistant turns is found from character spans: rendering the conversation up to an assistant
turn with the generation prompt gives where the answer starts, rendering it through that turn gives where it
ends, and the tokenizer's offset mapping turns the spans into token labels. This works with any template
whose renderings of a shorter conversation are a prefix of the full one, which holds for the common families;
when it does not, only the final answer is learned.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.data.files import Completion, Conversation, Example
from engine.data.packing import IGNORE_INDEX, TokenizedExample

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def ensure_chat_template(tokenizer: Any) -> bool:
    """Give the tokenizer the built-in ChatML template if it has none; True when it was added."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = CHATML_TEMPLATE
    return True


@dataclass
class TokenizeReport:
    """What happened to the examples on the way to tokens."""

    kept: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_untrained: int = 0
    template_fallbacks: int = 0


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], generation_prompt: bool = False) -> str:
    text: str = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
    return text


def assistant_spans(tokenizer: Any, conversation: Conversation) -> tuple[str, list[tuple[int, int]], bool]:
    """The rendered text and the character spans of assistant turns; the flag says the fallback was used."""
    messages = [{"role": m.role, "content": m.content} for m in conversation.messages]
    text = _render(tokenizer, messages)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start_text = _render(tokenizer, messages[:index], generation_prompt=True)
        end_text = _render(tokenizer, messages[: index + 1])
        if not (text.startswith(start_text) and text.startswith(end_text) and len(end_text) > len(start_text)):
            return text, _last_answer_span(tokenizer, messages, text), True
        spans.append((len(start_text), len(end_text)))
    return text, spans, False


def _last_answer_span(tokenizer: Any, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = _render(tokenizer, messages[:last], generation_prompt=True)
    start = len(prompt) if text.startswith(prompt) else text.rfind(messages[last]["content"])
    return [(max(start, 0), len(text))]


def _labels_from_spans(
    offsets: Sequence[tuple[int, int]], ids: Sequence[int], spans: Iterable[tuple[int, int]]
) -> list[int]:
    spans = list(spans)
    labels = []
    for token, (start, end) in zip(ids, offsets, strict=True):
        # overlap, not containment: a merged token that straddles the boundary (" brown") must be predicted too
        inside = end > start and any(start < hi and end > lo for lo, hi in spans)
        labels.append(token if inside else IGNORE_INDEX)
    return labels


def tokenize_example(tokenizer: Any, example: Example, train_on_all: bool) -> tuple[TokenizedExample, bool]:
    """Tokens and labels of one example; the flag says the template fallback was used."""
    fallback = False
    if isinstance(example, Conversation):
        text, spans, fallback = assistant_spans(tokenizer, example)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    else:
        text = example.prompt + example.completion
        spans = [(len(example.prompt), len(text))]
        encoded = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    labels = list(ids) if train_on_all else _labels_from_spans(encoded["offset_mapping"], ids, spans)
    if isinstance(example, Completion) and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)  # teach the model to stop after a completion
        labels.append(tokenizer.eos_token_id)
    return TokenizedExample(tuple(ids), tuple(labels)), fallback


def tokenize_examples(
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    max_seq_len: int,
    overlong: str = "truncate",
    train_on_all: bool = False,
) -> tuple[list[TokenizedExample], TokenizeReport]:
    """Tokenize every example, truncating or dropping over-long ones and dropping ones with nothing to learn."""
    report = TokenizeReport()
    result = []
    for example in examples:
        tokenized, fallback = tokenize_example(tokenizer, example, train_on_all)
        report.template_fallbacks += fallback
        if len(tokenized) > max_seq_len:
            if overlong == "drop":
                report.dropped_overlong += 1
                continue
            report.truncated += 1
            tokenized = TokenizedExample(tokenized.input_ids[:max_seq_len], tokenized.labels[:max_seq_len])
        if tokenized.trained_tokens == 0:
            report.dropped_untrained += 1
            continue
        result.append(tokenized)
    report.kept = len(result)
    return result, report
