"""Loss masks: by default only assistant/completion tokens are learned."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.data.files import Completion, Conversation, Message
from engine.data.packing import IGNORE_INDEX
from engine.data.tokenize import ensure_chat_template, tokenize_example, tokenize_examples


@pytest.fixture
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ensure_chat_template(tok)
    return tok


def _trained_text(tokenizer, example) -> str:
    ids = [label for label in example.labels if label != IGNORE_INDEX]
    return tokenizer.decode(ids)


def test_only_assistant_turns_are_learned(tokenizer) -> None:
    chat = Conversation(
        (
            Message("system", "be brief"),
            Message("user", "first question"),
            Message("assistant", "answer one"),
            Message("user", "second question"),
            Message("assistant", "answer two"),
        )
    )
    tokenized, fallback = tokenize_example(tokenizer, chat, train_on_all=False)
    assert not fallback
    learned = _trained_text(tokenizer, tokenized)
    assert "answer one" in learned and "answer two" in learned
    assert "question" not in learned and "brief" not in learned
    assert learned.count("<|im_end|>") == 2  # the model learns to stop


def test_train_on_all_tokens(tokenizer) -> None:
    chat = Conversation((Message("user", "hello there"), Message("assistant", "how are you")))
    tokenized, _ = tokenize_example(tokenizer, chat, train_on_all=True)
    assert list(tokenized.labels) == list(tokenized.input_ids)


def test_completion_learns_completion_and_eos(tokenizer) -> None:
    tokenized, _ = tokenize_example(tokenizer, Completion("the quick ", "brown fox"), train_on_all=False)
    learned = _trained_text(tokenizer, tokenized)
    assert learned.strip().startswith("brown fox") and learned.endswith("<|im_end|>")
    assert "quick" not in learned


def test_overlong_examples_truncated_or_dropped(tokenizer) -> None:
    long = Completion("", "the quick brown fox jumps over the lazy dog " * 20)
    short = Completion("", "hello")
    kept, report = tokenize_examples(tokenizer, [long, short], max_seq_len=32, overlong="truncate")
    assert report.truncated == 1 and len(kept) == 2 and len(kept[0]) == 32
    kept, report = tokenize_examples(tokenizer, [long, short], max_seq_len=32, overlong="drop")
    assert report.dropped_overlong == 1 and len(kept) == 1


def test_examples_with_nothing_to_learn_are_dropped(tokenizer) -> None:
    long_prompt = Completion("the quick brown fox jumps over the lazy dog " * 10, "end")
    kept, report = tokenize_examples(tokenizer, [long_prompt], max_seq_len=16, overlong="truncate")
    assert kept == [] and report.dropped_untrained == 1
