"""What the Dataset page shows, computed by the engine without Qt: counts, bad rows, lengths, packing and a preview
tokenized as training tokenizes it, with the model's tokenizer read from this computer only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import write_jsonl

from engine.config import DataConfig, ModelConfig
from engine.data.files import load_examples
from engine.data.tokenize import ensure_chat_template, tokenize_examples
from engine.errors import DataError, ModelLoadError
from engine.hardware.row_lengths import GPU_TOKENS_PER_BATCH
from engine.model.load import load_tokenizer
from engine.run import data_report
from engine.run.data_report import NO_TOKENIZER, analyze_dataset

CHATS = [
    {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"number {i}"}]}
    for i in range(5)
]
BAD = {"messages": [{"role": "user", "content": "no answer"}, {"role": "assistant", "content": 7}]}


def test_the_report_counts_rows_and_tokenizes_as_training_does(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [*CHATS[:2], BAD, *CHATS[2:]])
    report = analyze_dataset(str(path), str(tiny_model_dir))
    assert (report.data_format, report.rows, report.good_rows) == ("messages", 6, 5)
    assert [row for row, _, _ in report.problems] == [3]
    tokenizer = load_tokenizer(ModelConfig(name=str(tiny_model_dir)))
    ensure_chat_template(tokenizer)
    examples, _ = load_examples(str(write_jsonl(tmp_path / "good.jsonl", CHATS)), "messages")
    tokenized, _ = tokenize_examples(tokenizer, examples, max_seq_len=4096, overlong="truncate", train_on_all=False)
    assert report.lengths == [len(ex) for ex in tokenized]
    assert report.total_tokens == sum(report.lengths)
    assert report.trained_tokens == sum(ex.trained_tokens for ex in tokenized) < report.total_tokens
    assert report.tokens_per_batch == GPU_TOKENS_PER_BATCH and report.packed_rows == 1
    assert report.packing_efficiency == pytest.approx(report.total_tokens / GPU_TOKENS_PER_BATCH)
    assert len(report.preview) == data_report.PREVIEW_EXAMPLES and not report.sampled
    first = report.preview[0]
    assert "".join(text for text, _ in first) == tokenizer.decode(list(tokenized[0].input_ids))
    learned = "".join(text for text, trained in first if trained)
    assert "number 0" in learned and "say 0" not in learned, "only the answer is learned"


def test_rows_are_longer_than_the_batch_when_an_example_is(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    report = analyze_dataset(str(path), str(tiny_model_dir), DataConfig(path=str(path), tokens_per_batch=8))
    assert report.tokens_per_batch == max(report.lengths) > 8
    assert report.packed_rows == len(CHATS)


def test_a_large_dataset_is_sampled_from_the_start(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(data_report, "MAX_TOKENIZED", 2)
    report = analyze_dataset(str(write_jsonl(tmp_path / "chat.jsonl", CHATS)), str(tiny_model_dir))
    assert report.sampled and report.good_rows == 5 and len(report.lengths) == 2


def test_a_broken_file_is_reported_before_any_tokenizer_is_looked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[Any] = []
    monkeypatch.setattr(data_report, "tokenizer_on_disk", lambda *args: asked.append(args))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": \n', encoding="utf-8")
    with pytest.raises(DataError):
        analyze_dataset(str(broken), "Qwen/Qwen3-0.6B")
    assert asked == []


def test_a_hub_tokenizer_missing_here_is_the_models_fault_and_nothing_is_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr("socket.socket.connect", lambda *args: pytest.fail("a request was sent"))
    path = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ModelLoadError) as caught:
        analyze_dataset(str(path), "Qwen/Qwen3-0.6B")
    assert caught.value.message == f"{NO_TOKENIZER} Qwen/Qwen3-0.6B: it is not on this computer"
    assert caught.value.hint is not None and "button" in caught.value.hint
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no button can fetch it: the error says why instead
    with pytest.raises(ModelLoadError) as caught:
        analyze_dataset(str(path), "Qwen/Qwen3-0.6B")
    assert caught.value.message.endswith("it is not on this computer and offline mode is on: it cannot be fetched")
    assert caught.value.hint is not None and "unset HF_HUB_OFFLINE" in caught.value.hint
