"""Rendering examples to tokens, with labels only where the model should learn.

Chats are rendered with the tokenizer's own chat template (a built-in ChatML one when it has none). Which
tokens belong to assistant turns is found from character spans: rendering the conversation up to an assistant
turn with the generation prompt gives where the answer starts, rendering it through that turn gives where it
ends, and the tokenizer's offset mapping turns the spans into token labels. This works with any template
whose renderings of a shorter conversation are a prefix of the full one, which holds for the common families;
when it does not, only the final answer is learned.

A preference pair is tokenized as TRL's DPO trainer tokenizes it, so that a pair means the same tokens here and
there: the prompt alone (chat: rendered with the generation prompt) and the prompt followed by each answer (text
answers get the EOS token appended as text); each answer's tokens start where its full tokens stop agreeing with
the prompt's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.data.files import Completion, Conversation, Example, Message, PreferencePair
from engine.data.packing import IGNORE_INDEX, TokenizedExample, TokenizedPair

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


def _answer_ids(tokenizer: Any, prompt: str | tuple[Message, ...], answer: str | tuple[Message, ...]) -> list[int]:
    """The prompt followed by one answer, as tokens."""
    if isinstance(prompt, tuple) and isinstance(answer, tuple):
        messages = [{"role": m.role, "content": m.content} for m in (*prompt, *answer)]
        return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    eos = tokenizer.eos_token or ""
    text = f"{prompt}{answer}"
    return list(tokenizer(text if text.endswith(eos) else text + eos)["input_ids"])


def _prompt_ids(tokenizer: Any, prompt: str | tuple[Message, ...]) -> list[int]:
    if isinstance(prompt, tuple):
        messages = [{"role": m.role, "content": m.content} for m in prompt]
        rendered = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)
        return list(rendered["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def _shared_prefix(ids: Sequence[int], other: Sequence[int]) -> int:
    length = 0
    for token, other_token in zip(ids, other, strict=False):
        if token != other_token:
            break
        length += 1
    return length


def tokenize_pair(tokenizer: Any, pair: PreferencePair) -> TokenizedPair:
    """The pair's chosen and rejected documents, each the prompt's tokens (unlearned) and the answer's (learned)."""
    prompt = _prompt_ids(tokenizer, pair.prompt)
    chosen, rejected = (_answer_ids(tokenizer, pair.prompt, answer) for answer in (pair.chosen, pair.rejected))
    cut = min(_shared_prefix(prompt, chosen), _shared_prefix(prompt, rejected))
    labels = [[IGNORE_INDEX] * cut + ids[cut:] for ids in (chosen, rejected)]
    return TokenizedPair(tuple(chosen + rejected), tuple(labels[0] + labels[1]), chosen_length=len(chosen))


def _fit_pair(pair: TokenizedPair, max_seq_len: int, overlong: str, report: TokenizeReport) -> TokenizedPair | None:
    """Each answer's document cut to ``max_seq_len`` (its end goes, as TRL's keep_start), or the pair dropped."""
    documents = list(pair.documents())
    if any(len(document) > max_seq_len for document in documents):
        if overlong == "drop":
            report.dropped_overlong += 1
            return None
        report.truncated += 1
        documents = [TokenizedExample(d.input_ids[:max_seq_len], d.labels[:max_seq_len]) for d in documents]
    if any(document.trained_tokens == 0 for document in documents):
        report.dropped_untrained += 1
        return None
    chosen, rejected = documents
    return TokenizedPair(
        chosen.input_ids + rejected.input_ids, chosen.labels + rejected.labels, chosen_length=len(chosen)
    )


def tokenize_example(tokenizer: Any, example: Example, train_on_all: bool) -> tuple[TokenizedExample, bool]:
    """Tokens and labels of one example; the flag says the template fallback was used."""
    if isinstance(example, PreferencePair):
        return tokenize_pair(tokenizer, example), False
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
    result: list[TokenizedExample] = []
    for example in examples:
        tokenized, fallback = tokenize_example(tokenizer, example, train_on_all)
        report.template_fallbacks += fallback
        if isinstance(tokenized, TokenizedPair):
            fitted = _fit_pair(tokenized, max_seq_len, overlong, report)
            if fitted is not None:
                result.append(fitted)
            continue
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
