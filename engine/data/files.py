"""Reading a dataset file and normalising its rows, with errors that name the file, row and field.

JSON and JSONL are parsed here, one line at a time, so that every problem names its line: Arrow's JSON reader
reports a malformed line, a column whose type changes between rows, or a line longer than its block size as an
error that names neither the line nor the problem. CSV, Parquet and ``save_to_disk`` folders are read through
Hugging Face ``datasets``. Anything a stranger's file can do ends in a :class:`DataError`: files that are empty,
too large (``MAX_FILE_BYTES``), not regular files (a pipe would block forever), not UTF-8, nested deeper than the
parser's recursion limit, or holding unpaired surrogates that no tokenizer can encode. Rows are then normalised
to one of two shapes:

* :class:`Conversation` — chat messages (``messages``), ShareGPT (``conversations``), Alpaca
  (instruction/input/output): rendered with a chat template, loss on assistant turns;
* :class:`Completion` — prompt/completion and raw ``text``: plain text, loss on the completion (or everything);
* :class:`PreferencePair` — a prompt with a chosen and a rejected answer (``training.method`` dpo): text
  (``prompt``/``chosen``/``rejected`` strings) or chat (``chosen``/``rejected`` message lists that share the
  prompt's turns, or a ``prompt`` message list with the answers' assistant turns), as TRL reads them.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import DataError

FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion", "text", "preference")
FILE_TYPES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_FILE_BYTES = 4 * 1024**3
"""Largest dataset file read (rows are held in memory); bigger ones should be split or saved as a dataset folder."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class Conversation:
    """A chat: loss on assistant messages (unless training on everything)."""

    messages: tuple[Message, ...]


@dataclass(frozen=True)
class Completion:
    """Plain text: ``prompt`` is context only, ``completion`` is learned (raw text has an empty prompt)."""

    prompt: str
    completion: str


@dataclass(frozen=True)
class PreferencePair:
    """A prompt and two answers, the chosen one preferred. All three are text, or all three are chat turns
    (``prompt`` the turns before the answers, each answer the assistant turns that follow them)."""

    prompt: str | tuple[Message, ...]
    chosen: str | tuple[Message, ...]
    rejected: str | tuple[Message, ...]

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, tuple)


Example = Conversation | Completion | PreferencePair


def read_rows(path: str | os.PathLike[str], *, max_bytes: int = MAX_FILE_BYTES) -> list[dict[str, Any]]:
    """All rows of a dataset file or ``save_to_disk`` folder, as dicts."""
    source = Path(path).expanduser()
    if not source.exists():
        raise DataError("no such file or folder", path=str(source), hint="check the --data path")
    if source.is_dir():
        return _read_saved_dataset(source)
    kind = FILE_TYPES.get(source.suffix.lower())
    if kind is None:
        raise DataError(
            f"unsupported file type '{source.suffix}'",
            path=str(source),
            hint="use .jsonl, .json, .csv, .parquet or a folder written by datasets' save_to_disk",
        )
    _check_size(source, max_bytes)
    try:
        rows = _read_json(source) if kind == "json" else _read_tabular(kind, source)
    except OSError as err:
        raise DataError(f"cannot read the file: {err.strerror or err}", path=str(source)) from err
    if not rows:
        raise DataError("the file has no rows", path=str(source))
    return rows


def _check_size(source: Path, max_bytes: int) -> None:
    if not source.is_file():
        raise DataError("not a regular file (a pipe or device cannot be read as a dataset)", path=str(source))
    size = source.stat().st_size
    if size == 0:
        raise DataError("the file is empty", path=str(source))
    if size > max_bytes:
        raise DataError(
            f"the file is too large ({_human_size(size)}; the limit is {_human_size(max_bytes)})",
            path=str(source),
            hint="split it into several files, or save it as a dataset folder with datasets' save_to_disk",
        )


def _human_size(size: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024  # type: ignore[assignment]
    return f"{size} bytes"


def _read_tabular(kind: str, source: Path) -> list[dict[str, Any]]:
    if kind == "csv":
        _check_utf8(source)
    return _load_with_datasets(kind, source)


def _load_with_datasets(kind: str, source: Path) -> list[dict[str, Any]]:
    import datasets

    datasets.disable_progress_bars()
    try:
        options = _csv_options(source) if kind == "csv" else {}
        dataset = datasets.load_dataset(kind, data_files=str(source), split="train", **options)
    except Exception as err:  # datasets/pyarrow raise many types; all mean "this file can't be read"
        raise DataError(f"cannot read the file as {kind}: {_first_line(err)}", path=str(source)) from err
    rows: list[dict[str, Any]] = dataset.to_list()
    return rows


def _csv_options(source: Path) -> dict[str, Any]:
    """CSV cells are text: otherwise "4" would become an int and "NA" a missing value."""
    import csv

    import datasets

    try:
        with source.open(encoding="utf-8", newline="") as handle:
            reader = csv.reader(handle)
            header, first_row = next(reader, []), next(reader, None)
    except csv.Error as err:
        raise DataError(f"the first lines are not valid CSV: {err}", path=str(source)) from err
    if first_row is None:
        raise DataError("the file has no rows (only a header line)", path=str(source))
    features = datasets.Features({name: datasets.Value("string") for name in header})
    return {"features": features, "keep_default_na": False}


def _read_saved_dataset(folder: Path) -> list[dict[str, Any]]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(folder))
    except Exception as err:
        raise DataError(
            f"not a dataset folder: {_first_line(err)}",
            path=str(folder),
            hint="a folder must be written by datasets' save_to_disk",
        ) from err
    if isinstance(loaded, datasets.DatasetDict):
        split = "train" if "train" in loaded else next(iter(loaded))
        loaded = loaded[split]
    rows: list[dict[str, Any]] = loaded.to_list()
    if not rows:
        raise DataError("the dataset has no rows", path=str(folder))
    return rows


def _check_utf8(source: Path) -> None:
    with source.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"line {line_no} is not valid UTF-8 ({err.reason} at byte {err.start})",
                    path=str(source),
                    hint="save the file as UTF-8",
                ) from err


def _read_json(source: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file (one object per line) or a JSON array, with errors that name the line."""
    _check_utf8(source)
    first = _first_visible_char(source)
    if first is None:
        raise DataError("the file has only whitespace", path=str(source))
    if first == "[":
        return _read_json_array(source)
    rows = []
    with source.open(encoding="utf-8-sig") as handle:  # -sig: a byte-order mark from Windows editors is fine
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            value = _parse_json(line, source, f"line {line_no}")
            if not isinstance(value, dict):
                raise DataError(f"line {line_no} must be a JSON object, got {type(value).__name__}", path=str(source))
            rows.append(value)
    return rows


def _first_visible_char(source: Path) -> str | None:
    with source.open(encoding="utf-8-sig") as handle:
        for block in iter(lambda: handle.read(1 << 16), ""):
            stripped = block.lstrip()
            if stripped:
                return stripped[0]
    return None


def _parse_json(text: str, source: Path, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        if where.startswith("line"):
            message = f"{where} is not valid JSON: {err.msg} (column {err.colno})"
        else:
            message = f"not valid JSON at line {err.lineno}, column {err.colno}: {err.msg}"
        raise DataError(message, path=str(source)) from None
    except RecursionError:
        raise DataError(
            f"{where} is nested too deeply to read (over {sys.getrecursionlimit()} levels)", path=str(source)
        ) from None
    except ValueError as err:  # e.g. an integer with more digits than Python converts
        raise DataError(f"{where} cannot be read: {_first_line(err)}", path=str(source)) from None


def _read_json_array(source: Path) -> list[dict[str, Any]]:
    value = _parse_json(source.read_text(encoding="utf-8-sig"), source, "the JSON document")
    if not isinstance(value, list):
        raise DataError("a .json file must hold an array of objects (or one object per line)", path=str(source))
    for index, item in enumerate(value, start=1):
        if not isinstance(item, dict):
            raise DataError(f"must be a JSON object, got {type(item).__name__}", path=str(source), row=index)
    return value


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0][:300]


def detect_format(rows: Sequence[dict[str, Any]], path: str | None = None) -> str:
    """The row format, from the columns of the first row."""
    columns = set(rows[0]) if rows else set()
    if {"chosen", "rejected"} <= columns:
        return "preference"
    if "messages" in columns:
        return "messages"
    if "conversations" in columns:
        return "sharegpt"
    if {"instruction", "output"} <= columns:
        return "alpaca"
    if {"prompt", "completion"} <= columns:
        return "prompt_completion"
    if "text" in columns:
        return "text"
    raise DataError(
        f"unknown dataset format; columns: {', '.join(sorted(columns)) or 'none'}",
        path=path,
        hint="expected 'messages', 'conversations', instruction/output, prompt/completion or 'text'; "
        "preference pairs: prompt/chosen/rejected",
    )


def normalize_rows(rows: Sequence[dict[str, Any]], fmt: str, path: str | None = None) -> list[Example]:
    """Every row as a Conversation or Completion; the first bad row raises a DataError naming it (1-based)."""
    convert = _CONVERTERS.get(fmt)
    if convert is None:
        raise DataError(f"unknown format '{fmt}'; known: {', '.join(FORMATS)}", path=path)
    examples: list[Example] = []
    for index, row in enumerate(rows, start=1):
        try:
            examples.append(convert(row))
        except _RowError as err:
            raise DataError(err.message, path=path, row=index, field=err.field) from None
    return examples


def iter_row_problems(rows: Sequence[dict[str, Any]], fmt: str) -> Iterator[tuple[int, str, str]]:
    """(row, field, message) for every bad row, for views that list problems instead of stopping at the first."""
    convert = _CONVERTERS[fmt]
    for index, row in enumerate(rows, start=1):
        try:
            convert(row)
        except _RowError as err:
            yield index, err.field, err.message


class _RowError(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _text(row: dict[str, Any], key: str, *, optional: bool = False) -> str:
    value = row.get(key)
    if value is None:
        if optional:
            return ""
        raise _RowError(key, "missing")
    return _checked_text(value, key)


def _checked_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _RowError(where, f"must be text, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:  # JSON escapes like "\ud800" decode to text no tokenizer can encode
        raise _RowError(where, f"holds invalid Unicode (an unpaired surrogate at character {err.start})") from None
    return value


def _messages(row: dict[str, Any], key: str, role_key: str, content_key: str, roles: dict[str, str]) -> Conversation:
    if row.get(key) is None:
        raise _RowError(key, "missing")
    messages = _turns(row, key, roles, role_key, content_key)
    if not any(m.role == "assistant" for m in messages):
        raise _RowError(key, "has no assistant message to learn from")
    return Conversation(messages)


def _from_messages(row: dict[str, Any]) -> Conversation:
    return _messages(row, "messages", "role", "content", {r: r for r in CHAT_ROLES})


def _from_sharegpt(row: dict[str, Any]) -> Conversation:
    return _messages(row, "conversations", "from", "value", SHAREGPT_ROLES)


def _from_alpaca(row: dict[str, Any]) -> Conversation:
    instruction, extra, output = _text(row, "instruction"), _text(row, "input", optional=True), _text(row, "output")
    if not instruction.strip():
        raise _RowError("instruction", "is empty")
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return Conversation((Message("user", prompt), Message("assistant", output)))


def _from_prompt_completion(row: dict[str, Any]) -> Completion:
    completion = _text(row, "completion")
    if not completion:
        raise _RowError("completion", "is empty")
    return Completion(_text(row, "prompt"), completion)


def _from_text(row: dict[str, Any]) -> Completion:
    text = _text(row, "text")
    if not text.strip():
        raise _RowError("text", "is empty")
    return Completion("", text)


def _from_preference(row: dict[str, Any]) -> PreferencePair:
    """A pair as TRL reads it: strings, or message lists where a missing prompt is the turns both answers share."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None:
            raise _RowError(key, "missing")
    if isinstance(chosen, str) or isinstance(rejected, str):
        if not (isinstance(chosen, str) and isinstance(rejected, str)):
            raise _RowError("rejected", "must be text like 'chosen', or both must be message lists")
        return _text_pair(row)
    return _chat_pair(row)


def _text_pair(row: dict[str, Any]) -> PreferencePair:
    if row.get("prompt") is None:
        raise _RowError("prompt", "missing (text answers need the prompt they answer)")
    prompt, chosen, rejected = _text(row, "prompt"), _text(row, "chosen"), _text(row, "rejected")
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if not value.strip():
            raise _RowError(key, "is empty")
    if chosen == rejected:
        raise _RowError("rejected", "is the same as the chosen answer: nothing to prefer")
    return PreferencePair(prompt, chosen, rejected)


def _chat_pair(row: dict[str, Any]) -> PreferencePair:
    roles = {r: r for r in CHAT_ROLES}
    chosen = _turns(row, "chosen", roles)
    rejected = _turns(row, "rejected", roles)
    if row.get("prompt") is not None:
        prompt = _turns(row, "prompt", roles)
    else:  # the prompt is the turns both answers start with (TRL's extract_prompt)
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:
            raise _RowError("prompt", "missing, and 'chosen' and 'rejected' share no first turn to take it from")
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    for key, answer in (("chosen", chosen), ("rejected", rejected)):
        if not answer or not any(m.role == "assistant" for m in answer):
            raise _RowError(key, "has no assistant answer after the prompt")
    if chosen == rejected:
        raise _RowError("rejected", "is the same as the chosen answer: nothing to prefer")
    return PreferencePair(prompt, chosen, rejected)


def _turns(
    row: dict[str, Any], key: str, roles: dict[str, str], role_key: str = "role", content_key: str = "content"
) -> tuple[Message, ...]:
    """``row[key]``'s messages, their roles mapped through ``roles``; a bad one is named by its place."""
    raw = row.get(key)
    if not isinstance(raw, list) or not raw:
        raise _RowError(key, "must be a non-empty list of messages")
    messages = []
    for number, item in enumerate(raw, start=1):
        where = f"{key}[{number}]"
        if not isinstance(item, dict):
            raise _RowError(where, f"must be an object, got {type(item).__name__}")
        role = item.get(role_key)
        if not isinstance(role, str) or role not in roles:
            shown = repr(role[:40]) if isinstance(role, str) else f"of type {type(role).__name__}"
            raise _RowError(f"{where}.{role_key}", f"unknown role {shown}; expected one of {', '.join(roles)}")
        messages.append(Message(roles[role], _checked_text(item.get(content_key), f"{where}.{content_key}")))
    return tuple(messages)


_CONVERTERS: dict[str, Callable[[dict[str, Any]], Example]] = {
    "messages": _from_messages,
    "sharegpt": _from_sharegpt,
    "alpaca": _from_alpaca,
    "prompt_completion": _from_prompt_completion,
    "text": _from_text,
    "preference": _from_preference,
}


def load_examples(path: str | os.PathLike[str], fmt: str = "auto") -> tuple[list[Example], str]:
    """Read, detect and normalise a dataset; returns the examples and the format used."""
    rows = read_rows(path)
    chosen = detect_format(rows, str(path)) if fmt == "auto" else fmt
    return normalize_rows(rows, chosen, str(path)), chosen
