"""Reading image-and-text examples: chat rows with image parts, or a folder of images with a captions file.

Chat rows are JSONL (or a JSON list) in the message shape the processors use::

    {"messages": [{"role": "user", "content": [{"type": "image", "image": "photos/receipt1.jpg"},
                                               {"type": "text", "text": "What is the total?"}]},
                  {"role": "assistant", "content": "12.40"}]}

An image part names a file relative to the data file's folder (``image`` or ``path``). A folder of images holds a
``captions``, ``labels`` or ``metadata`` file (``.csv`` or ``.jsonl``) whose rows name an image (``file_name``,
``image``, ``file`` or ``path``) and its text (``caption``, ``text``, ``label`` or ``answer``), and optionally the
question to ask (``prompt`` or ``question``; otherwise :data:`DEFAULT_PROMPT`). Only assistant text is learned.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import DataError
from engine.vision.images import ImageRef

DEFAULT_PROMPT = "Describe this image."
LABEL_FILES = ("captions", "labels", "metadata")
IMAGE_COLUMNS = ("file_name", "image", "file", "path")
TEXT_COLUMNS = ("caption", "text", "label", "answer")
PROMPT_COLUMNS = ("prompt", "question")


@dataclass(frozen=True)
class VisionExample:
    """One conversation: its messages with image parts reduced to ``{"type": "image"}``, and its images in order."""

    messages: tuple[dict[str, Any], ...]
    images: tuple[ImageRef, ...]
    data_file: str
    row: int

    def images_before(self, turn: int) -> int:
        """How many images the messages before ``turn`` hold."""
        return sum(_image_count(message) for message in self.messages[:turn])

    @property
    def answer(self) -> str:
        """The text of the last assistant turn (what a held-out example expects)."""
        return _text_of(self.messages[-1])

    @property
    def prompt(self) -> tuple[dict[str, Any], ...]:
        """The messages before the last assistant turn."""
        return self.messages[:-1]


def load_vision_examples(path: str | Path) -> list[VisionExample]:
    """The examples of a chat-rows file, or of a folder of images with a captions/labels file."""
    location = Path(path).expanduser()
    if location.is_dir():
        return _folder_examples(location)
    if not location.is_file():
        raise DataError("no such file or folder", path=str(location))
    return [_chat_example(row, location, i) for i, row in enumerate(_read_rows(location), start=1)]


def _read_rows(path: Path) -> list[Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"cannot be read ({err})", path=str(path)) from err
    if path.suffix == ".csv":
        return list(csv.DictReader(text.splitlines()))
    if path.suffix == ".json":
        rows = _parse(text, path, None)
        if not isinstance(rows, list):
            raise DataError("a .json dataset must be a list of rows", path=str(path))
        return rows
    return [_parse(line, path, i) for i, line in enumerate(text.splitlines(), start=1) if line.strip()]


def _parse(text: str, path: Path, row: int | None) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"not valid JSON ({err.msg})", path=str(path), row=row) from err


def _chat_example(row: Any, path: Path, index: int) -> VisionExample:
    where: dict[str, Any] = {"path": str(path), "row": index}
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError("a row needs a non-empty 'messages' list", field="messages", **where)
    shaped, images = [], []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise DataError("each message needs a role: system, user or assistant", field="messages", **where)
        content, named = _content(message.get("content"), where)
        if named and message["role"] == "assistant":
            raise DataError("images belong in user turns; assistant turns are text", field="messages", **where)
        shaped.append({"role": message["role"], "content": content})
        images += [ImageRef(path.parent / name, str(path), index, name) for name in named]
    if shaped[-1]["role"] != "assistant" or not _text_of(shaped[-1]).strip():
        raise DataError("the last message must be the assistant's answer", field="messages", **where)
    return VisionExample(tuple(shaped), tuple(images), str(path), index)


def _content(content: Any, where: dict[str, Any]) -> tuple[str | list[dict[str, Any]], list[str]]:
    """The content in the processors' shape and the image files it names, in order."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise DataError("content must be text or a list of parts", field="content", **where)
    parts, named = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            name = part.get("image", part.get("path"))
            if not isinstance(name, str) or not name:
                raise DataError("an image part needs the image's file path in 'image'", field="content", **where)
            parts.append({"type": "image"})
            named.append(name)
        else:
            raise DataError(
                'each part is {"type": "text", "text": ...} or {"type": "image", "image": PATH}',
                field="content",
                **where,
            )
    return parts, named


def _folder_examples(folder: Path) -> list[VisionExample]:
    found = [folder / f"{stem}{suffix}" for stem in LABEL_FILES for suffix in (".csv", ".jsonl")]
    labels = next((path for path in found if path.is_file()), None)
    if labels is None:
        raise DataError(
            "a folder of images needs a captions or labels file",
            path=str(folder),
            hint="add captions.csv (or labels.csv, metadata.jsonl...) with a file_name and a caption/label column",
        )
    return [_captioned(row, labels, i) for i, row in enumerate(_read_rows(labels), start=1)]


def _captioned(row: Any, labels: Path, index: int) -> VisionExample:
    where: dict[str, Any] = {"path": str(labels), "row": index}
    if not isinstance(row, dict):
        raise DataError("each row must be an object with an image and its text", **where)
    image = _first(row, IMAGE_COLUMNS)
    text = _first(row, TEXT_COLUMNS)
    if image is None or text is None:
        raise DataError(
            f"a row needs an image column ({', '.join(IMAGE_COLUMNS)}) and a text column ({', '.join(TEXT_COLUMNS)})",
            **where,
        )
    prompt = _first(row, PROMPT_COLUMNS) or DEFAULT_PROMPT
    messages = (
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]},
        {"role": "assistant", "content": text},
    )
    return VisionExample(messages, (ImageRef(labels.parent / image, str(labels), index, image),), str(labels), index)


def _first(row: dict[str, Any], columns: tuple[str, ...]) -> str | None:
    for column in columns:
        value = row.get(column)
        if value is not None and str(value).strip():
            return str(value)
    return None


def _image_count(message: dict[str, Any]) -> int:
    content = message["content"]
    return 0 if isinstance(content, str) else sum(part["type"] == "image" for part in content)


def _text_of(message: dict[str, Any]) -> str:
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part["type"] == "text")
