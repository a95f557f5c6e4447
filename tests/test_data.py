"""Reading datasets in every supported format, and one clear error for every kind of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import write_jsonl

from engine.data.files import Completion, Conversation, load_examples, read_rows
from engine.errors import DataError

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
SHAREGPT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
ALPACA = {"instruction": "Greet", "input": "Bob", "output": "Hello Bob"}
PROMPT = {"prompt": "2+2=", "completion": "4"}
TEXT = {"text": "plain text to learn"}


@pytest.mark.parametrize(
    ("row", "fmt", "kind"),
    [
        (CHAT, "messages", Conversation),
        (SHAREGPT, "sharegpt", Conversation),
        (ALPACA, "alpaca", Conversation),
        (PROMPT, "prompt_completion", Completion),
        (TEXT, "text", Completion),
    ],
)
def test_formats_are_detected(tmp_path: Path, row: dict, fmt: str, kind: type) -> None:
    examples, detected = load_examples(write_jsonl(tmp_path / "d.jsonl", [row, row]))
    assert detected == fmt
    assert len(examples) == 2 and isinstance(examples[0], kind)


def test_alpaca_joins_instruction_and_input(tmp_path: Path) -> None:
    (example,), _ = load_examples(write_jsonl(tmp_path / "a.jsonl", [ALPACA]))
    assert isinstance(example, Conversation)
    assert [m.role for m in example.messages] == ["user", "assistant"]
    assert example.messages[0].content == "Greet\n\nBob"


def test_json_csv_parquet_and_saved_folder(tmp_path: Path) -> None:
    import datasets

    rows = [PROMPT, {"prompt": "3+3=", "completion": "6"}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    datasets.Dataset.from_list(rows).to_csv(str(tmp_path / "d.csv"), index=False)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    for name in ("d.json", "d.csv", "d.parquet", "saved"):
        examples, fmt = load_examples(tmp_path / name)
        assert fmt == "prompt_completion", name
        assert [e.completion for e in examples] == ["4", "6"], name


def _error(path: Path) -> DataError:
    with pytest.raises(DataError) as info:
        load_examples(path)
    return info.value


def test_malformed_json_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(CHAT) + "\n" + '{"messages": [oops\n')
    err = _error(path)
    assert "line 2 is not valid JSON" in str(err) and str(path) in str(err)


def test_missing_field_names_row_and_field(tmp_path: Path) -> None:
    err = _error(write_jsonl(tmp_path / "d.jsonl", [ALPACA, {"instruction": "x", "output": None}]))
    assert (err.row, err.field) == (2, "output")
    assert "row 2" in str(err) and "field 'output'" in str(err)


def test_wrong_type_names_the_nested_field(tmp_path: Path) -> None:
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]}
    err = _error(write_jsonl(tmp_path / "d.jsonl", [bad]))
    assert err.row == 1 and err.field == "messages[2].content"


def test_unknown_role_and_no_answer(tmp_path: Path) -> None:
    err = _error(write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "robot", "content": "x"}]}]))
    assert "unknown role" in str(err)
    err = _error(write_jsonl(tmp_path / "e.jsonl", [{"messages": [{"role": "user", "content": "x"}]}]))
    assert "no assistant message" in str(err)


def test_empty_and_whitespace_files(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    assert "empty" in str(_error(tmp_path / "empty.jsonl"))
    (tmp_path / "blank.jsonl").write_text("\n\n  \n")
    assert "whitespace" in str(_error(tmp_path / "blank.jsonl"))


def test_undecodable_bytes(tmp_path: Path) -> None:
    path = tmp_path / "latin.jsonl"
    path.write_bytes(json.dumps(TEXT).encode() + b"\n" + b'{"text": "caf\xe9"}\n')
    err = _error(path)
    assert "line 2 is not valid UTF-8" in str(err)


def test_unknown_format_lists_columns(tmp_path: Path) -> None:
    err = _error(write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}]))
    assert "unknown dataset format" in str(err) and "answer, question" in str(err)


def test_unsupported_extension_and_missing_path(tmp_path: Path) -> None:
    (tmp_path / "d.txt").write_text("hello")
    assert "unsupported file type" in str(_error(tmp_path / "d.txt"))
    assert "no such file" in str(_error(tmp_path / "missing.jsonl"))


def test_non_object_lines(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n[1, 2]\n')
    assert "line 2 must be a JSON object" in str(_error(tmp_path / "d.jsonl"))


def test_read_rows_keeps_all_rows(tmp_path: Path) -> None:
    rows = read_rows(write_jsonl(tmp_path / "d.jsonl", [TEXT] * 5))
    assert len(rows) == 5
